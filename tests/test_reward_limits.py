"""Rewards on adversarial model output: every pattern finishes within the worker limit.

The inputs are benchmarks/bench_rewards.py's catalogue of the worst inputs constructed
for each pattern; the benchmark times them, these tests only assert that each call ends
within the per-call limit of a reward worker (rl_config.reward_timeout_s's default).
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest

from mindspeed_rl.config.schema import RLConfig
from mindspeed_rl.rewards import get_verifier

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_rewards", ROOT / "benchmarks" / "bench_rewards.py")
bench_rewards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_rewards)

WORKER_LIMIT_S = RLConfig().reward_timeout_s
SIZE = 64 * 1024


class _PastTheLimit(BaseException):  # not swallowed by a verifier's except Exception
    pass


def _raise_past_the_limit(signum, frame):
    raise _PastTheLimit


@pytest.mark.parametrize("pattern", sorted(bench_rewards.ADVERSARIAL))
def test_adversarial_output_finishes_within_the_worker_limit(pattern):
    verifier, inputs = bench_rewards.ADVERSARIAL[pattern]
    fn = get_verifier(verifier)
    # SIGALRM interrupts a backtracking regex too (the regex engine polls for signals),
    # so a regression fails here instead of hanging the test run.
    previous = signal.signal(signal.SIGALRM, _raise_past_the_limit)
    try:
        for name, make in inputs.items():
            text = make(SIZE)
            assert len(text) >= SIZE - 64
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, WORKER_LIMIT_S)
            try:
                fn(text, "43")
            except _PastTheLimit:
                pass  # failed below, outside the interrupted frame
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert time.perf_counter() - start < WORKER_LIMIT_S, (
                f"{verifier} on {name!r} ({len(text)} characters) ran past the worker limit "
                f"of {WORKER_LIMIT_S} s")
    finally:
        signal.signal(signal.SIGALRM, previous)


# ---- the reward worker pool ------------------------------------------------------------------

import reward_verifiers_for_tests  # noqa: E402,F401 - registers the misbehaving verifiers

from mindspeed_rl.rewards import (RewardLimits, RewardPool, RewardPoolError,  # noqa: E402
                                  compute_rewards, register_verifier, registered_verifiers)

# math-verify's own SIGALRM timeout does not stop this one everywhere (Math-Verify's
# "forever hang" report: sympy on a tower of powers).
SYMPY_TOWER = (r"The answer is \boxed{\dfrac{5^{\left(5^{\left(5^{\left(5^5\right)}\right)} - 4"
               r"\right)} - 5}{16}}")
REAL_VERIFIERS = [name for name in registered_verifiers() if not name.startswith("test_")]


@pytest.fixture
def pool():
    names = REAL_VERIFIERS + ["test_bigint_in_c", "test_raises", "test_exits"]
    pool = RewardPool(2, RewardLimits(call_timeout_s=3.0, batch_timeout_s=240.0), names)
    yield pool
    pool.close()


def test_every_verifier_on_adversarial_output_finishes_in_the_pool(pool, capfd):
    """Each verifier on the 64 KB worst inputs and the sympy tower, plus a verifier stuck
    in C, one that raises and one whose process dies: the batch ends within its budget,
    the failed calls are counted and named with their rows, and the pool goes on."""
    responses = [next(iter(inputs.values()))(SIZE)
                 for _, inputs in bench_rewards.ADVERSARIAL.values()]
    responses += [SYMPY_TOWER, "power", "raise", "exit"]
    labels = [f"train.jsonl row {i}" for i in range(len(responses))]
    names = REAL_VERIFIERS + ["test_bigint_in_c", "test_raises", "test_exits"]
    start = time.monotonic()
    total, per = compute_rewards(responses, ["43"] * len(responses), names, [1.0] * len(names),
                                 row_labels=labels, pool=pool)
    assert time.monotonic() - start < pool.limits.batch_timeout_s
    timeouts, errors, unresponsive = pool.take_counts()
    assert timeouts >= 1 and errors == 2  # the C call; the exception and the dead worker
    assert unresponsive == 0
    assert per["test_bigint_in_c"][-3].item() == -2.0  # the verifier's failed score
    assert per["test_raises"][-2].item() == 0.0 and per["test_exits"][-1].item() == 0.0
    log = capfd.readouterr().err
    assert (f"reward: verifier 'test_bigint_in_c' timed out on train.jsonl row "
            f"{len(responses) - 3} (ran past rl_config.reward_timeout_s=3 s") in log
    assert (f"verifier 'test_raises' failed on train.jsonl row {len(responses) - 2} (raised "
            "ValueError: a verifier bug on this response)") in log
    assert "verifier 'test_exits' failed on train.jsonl row" in log and "exit status 3" in log
    assert pool.take_counts() == (0, 0, 0)
    # the job goes on: the replaced workers score the next batch
    total, _ = compute_rewards(["37 + 6 = 43. So the answer is 43."], ["43"],
                               ["integer_answer", "test_exits"], [1.0, 1.0], pool=pool)
    assert total.tolist() == [2.0] and pool.take_counts() == (0, 0, 0)


def test_batch_budget_scores_the_unfinished_calls_as_failed(capfd):
    pool = RewardPool(2, RewardLimits(call_timeout_s=60.0, batch_timeout_s=8.0,
                                      failed_score=-5.0), ["test_bigint_in_c"])
    try:
        start = time.monotonic()
        _, per = compute_rewards(["power"] * 5 + ["ok"], ["1"] * 6, ["test_bigint_in_c"], [1.0],
                                 pool=pool)
        assert time.monotonic() - start < 8.0 + 5.0  # the budget, and killing the workers
        assert per["test_bigint_in_c"].tolist()[:5] == [-5.0] * 5
        assert pool.take_counts()[0] >= 5
        assert "ran past its budget of 8 s (rl_config.reward_batch_timeout_s)" in capfd.readouterr().err
    finally:
        pool.close()
    assert all(w.process.poll() is not None for w in pool._workers)


def test_a_stopped_worker_does_not_block_the_rank(capfd):
    """An idle worker is stopped (SIGSTOP: a debugger, a frozen cgroup) and the
    responses are 1 MiB, more than its pipe holds. The request to it cannot block the rank:
    the batch returns within its budget, the stopped worker's call scores as failed and is
    counted as unresponsive (the reason on stderr), and the next batch scores normally."""
    import os
    import threading

    limits = RewardLimits(call_timeout_s=3.0, batch_timeout_s=20.0)
    pool = RewardPool(2, limits, ["integer_answer"])
    try:
        pool.score(["integer_answer"], ["the answer is 1"], ["1"])  # the workers are ready
        stopped = pool._workers[0].process
        os.kill(stopped.pid, signal.SIGSTOP)
        response = "x" * (1 << 20) + " the answer is 43"
        out = []
        scorer = threading.Thread(target=lambda: out.append(
            pool.score(["integer_answer"], [response] * 4, ["43"] * 4)), daemon=True)
        start = time.monotonic()
        scorer.start()
        scorer.join(limits.batch_timeout_s + 10)
        wall = time.monotonic() - start
        assert not scorer.is_alive(), "score() blocked on the stopped worker"
        print(f"batch with a stopped worker: {wall:.2f} s")
        assert wall < limits.batch_timeout_s
        [(scores, failures)] = out
        assert [f.kind for f in failures] == ["unresponsive"]
        assert scores["integer_answer"].count(1.0) == 3
        assert scores["integer_answer"][failures[0].index] == 0.0  # the failed score
        assert stopped.poll() is not None  # killed and replaced
        assert pool.take_counts() == (0, 0, 1)
        assert "did not take the request within rl_config.reward_timeout_s=3 s" in \
            capfd.readouterr().err
        scores, failures = pool.score(["integer_answer"], [response] * 4, ["43"] * 4)
        assert failures == [] and scores["integer_answer"] == [1.0] * 4
    finally:
        for worker in pool._workers:
            if worker.process.poll() is None:
                os.kill(worker.process.pid, signal.SIGCONT)
        pool.close()


def test_a_verifier_the_workers_cannot_import_is_named():
    @register_verifier("test_local_closure")
    def local(response: str, answer: str) -> float:
        return 1.0

    pool = RewardPool(1, RewardLimits(), ["integer_answer"])
    try:
        with pytest.raises(RewardPoolError, match=r"verifier 'test_local_closure' \(from "
                                                  r"test_reward_limits\) is not registered in a "
                                                  r"reward worker.*reward_workers: 0"):
            compute_rewards(["43"], ["43"], ["test_local_closure"], [1.0], pool=pool)
    finally:
        pool.close()


def test_a_worker_ends_when_its_rank_closes_the_pipe():
    """A reward worker answers its calls and returns when the rank's end of the pipe closes
    (a rank that ends without sending ``None``), not only on ``None``."""
    import multiprocessing as mp
    import threading

    from mindspeed_rl.rewards.worker import serve

    tasks_out, tasks_in = mp.Pipe(duplex=False)    # rank -> worker
    replies_out, replies_in = mp.Pipe(duplex=False)  # worker -> rank
    ended = []

    def run():
        try:
            serve(tasks_out, replies_in, [])
            ended.append("returned")
        except BaseException as error:  # noqa: BLE001 - the outcome under test
            ended.append(repr(error))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert replies_out.recv()[0] == "ready"
    tasks_in.send((7, "math_answer", "The answer is \\boxed{4}.", "4"))
    assert replies_out.recv() == (7, True, 1.0)
    tasks_in.close()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the worker kept waiting on a closed pipe"
    assert ended == ["returned"]
