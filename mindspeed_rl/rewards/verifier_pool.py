"""Rule verifiers in worker processes, every call bounded in time.

Model output is untrusted input to the verifiers: a regex can backtrack, sympy and
big-integer arithmetic can run for hours in C where math-verify's SIGALRM cannot stop
them, and in the training process any of that holds the GIL, so the rank also stops
sending heartbeats and its peers report it lost. Here each call runs in one of
``rl_config.reward_workers`` worker processes (each a fresh interpreter running
``mindspeed_rl.rewards.worker``: no torch, no process-group threads inherited), which
also scores a batch in parallel where the rank has cores to spare. A call past
``reward_timeout_s`` has its worker killed (SIGKILL) and replaced; a batch past
``reward_batch_timeout_s`` gives up on its unfinished calls. A call that timed out, raised,
or whose worker died scores the verifier's failed score (its lowest, so breaking a
verifier never pays), counts in ``reward/timeouts`` or ``reward/errors`` and is named in one
line on stderr with its row. The rank never blocks on a worker: a request larger than a
pipe's guaranteed room is written by a thread, so a worker that stops reading (SIGSTOP, a
debugger, a frozen cgroup) costs its call's time limit, not the rank's: it is killed and
replaced, and the call scores as failed and counts in ``reward/unresponsive_workers``. A
NaN/inf a verifier returns is still an error of the job (registry.compute_rewards): that
is a bug of the verifier, not of the output.

The workers ignore SIGINT and SIGTERM (a preempted rank finishes its iteration and saves:
its rewards must still come back) and die with the rank (PR_SET_PDEATHSIG on Linux, and
a finalizer at interpreter exit); ``RewardPool.close`` ends them.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler

from mindspeed_rl.rewards.registry import failed_score, get_verifier

_STARTUP_TIMEOUT_S = 300.0  # a spawned interpreter importing math-verify/sympy on a busy node
# A message of at most this many bytes (with Connection's 4-byte header) goes into an idle
# worker's empty pipe in one write that cannot block: POSIX guarantees PIPE_BUF (4096 on
# Linux) bytes of room, also in a pipe shrunk to one page. Larger ones are written by a thread.
_INLINE_BYTES = 4096 - 4


@dataclasses.dataclass(frozen=True)
class RewardLimits:
    """The time limits of reward scoring and the score of a failed call."""

    call_timeout_s: float = 10.0
    batch_timeout_s: float = 900.0
    failed_score: float | None = None  # None: each verifier's own (registry.failed_score)

    @classmethod
    def from_config(cls, rl) -> "RewardLimits":
        """From ``rl_config`` (reward_batch_timeout_s null = half the collective timeout)."""
        batch = rl.reward_batch_timeout_s
        return cls(call_timeout_s=rl.reward_timeout_s,
                   batch_timeout_s=batch if batch is not None else rl.collective_timeout_s / 2,
                   failed_score=rl.reward_failed_score)

    def score_of_failed(self, verifier: str) -> float:
        return self.failed_score if self.failed_score is not None else failed_score(verifier)


@dataclasses.dataclass(frozen=True)
class Failure:
    """A verifier call that produced no score: kind is "timeout", "error" or
    "unresponsive" (its worker did not take the request in time)."""

    kind: str
    verifier: str
    index: int  # the response's index in the batch
    detail: str


class RewardPoolError(RuntimeError):
    """The workers cannot run a verifier at all (not a problem of one response)."""


def default_workers() -> int:
    """This rank's share of the CPU cores it may run on, between 1 and 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (cores or 1) // max(ranks_here, 1)))


class _Worker:
    """One worker process (``python -m mindspeed_rl.rewards.worker``), the pipes to it,
    and the call it is running."""

    def __init__(self, modules: Sequence[str]) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        # Its own interpreter, not multiprocessing's spawn: that would re-run the launcher's
        # __main__ module in every worker. The rank's sys.path lets it import what we import.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mindspeed_rl.rewards.worker", str(to_child),
             str(from_child), str(os.getpid()), *modules],
            pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, env=env)
        os.close(to_child)
        os.close(from_child)
        self.send_conn = Connection(from_parent, readable=False)
        self.conn = Connection(to_parent, writable=False)
        self.started = time.monotonic()
        self.ready = False
        self.registered: set[str] = set()  # the verifier names the worker knows
        self.task: int | None = None
        self.deadline = 0.0
        self.sending: threading.Thread | None = None  # writing a large request

    def send(self, message) -> bool:
        """Start sending ``message`` (what ``Connection.send`` writes); False when the worker
        is gone. Never blocks: see ``_INLINE_BYTES``."""
        data = ForkingPickler.dumps(message)
        if self.sending is not None:  # the previous request was read whole (it was answered)
            self.sending.join()
        if len(data) <= _INLINE_BYTES:
            try:
                self.send_conn.send_bytes(data)
            except OSError:
                return False
            return True
        self.sending = threading.Thread(target=self._write, args=(data,), daemon=True,
                                        name="reward-request")
        self.sending.start()
        return True

    def _write(self, data) -> None:
        try:
            self.send_conn.send_bytes(data)
        except OSError:  # killed meanwhile (its call's deadline), or died: scored by the loop
            pass

    def took_request(self) -> bool:
        """Whether the worker has read the whole of its current request."""
        return self.sending is None or not self.sending.is_alive()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        if self.sending is not None:
            self.sending.join(timeout=10)  # its write fails (EPIPE) once the reader is gone
            if self.sending.is_alive():    # never close an fd another thread writes to
                self.conn.close()
                return
        self.send_conn.close()
        self.conn.close()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class RewardPool:
    """``workers`` processes that run verifier calls within ``limits``; one per job.

    ``score`` blocks until every call of the batch has a score (its own, or the failed
    score); ``take_counts`` returns the timeouts, errors and unresponsive workers since it
    was last called.
    """

    def __init__(self, workers: int, limits: RewardLimits,
                 verifier_names: Sequence[str] = ()) -> None:
        if workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {workers}")
        self.limits = limits
        # The workers import the modules that register the job's verifiers.
        self._modules = tuple(sorted({"mindspeed_rl.rewards"} | {
            get_verifier(name).__module__ for name in verifier_names} - {"__main__"}))
        self._workers = [_Worker(self._modules) for _ in range(workers)]
        self._close = multiprocessing.util.Finalize(self, _kill_all, args=(self._workers,),
                                                    exitpriority=10)
        self._timeouts = self._errors = self._unresponsive = 0
        self._startup_deaths = 0
        self.restarts = 0

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def take_counts(self) -> tuple[int, int, int]:
        """(timed-out calls, failed calls, calls whose worker did not take the request in
        time) since the last call of this method."""
        counts = (self._timeouts, self._errors, self._unresponsive)
        self._timeouts = self._errors = self._unresponsive = 0
        return counts

    def close(self) -> None:
        """End the workers (a stop request, then SIGKILL for any that does not stop)."""
        for worker in self._workers:
            if worker.ready and worker.task is None:
                try:
                    worker.send_conn.send(None)
                except OSError:
                    pass
        end = time.monotonic() + 2.0
        for worker in self._workers:
            try:
                worker.process.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._close()

    def score(self, names: Sequence[str], responses: Sequence[str],
              answers: Sequence[str | None], row_labels: Sequence[str] | None = None,
              ) -> tuple[dict[str, list[float]], list[Failure]]:
        """{verifier: [score of each response]} and the calls that failed, which score
        ``limits.score_of_failed(verifier)`` and are named on stderr, one line each."""
        calls = [(v, i) for i in range(len(responses)) for v in range(len(names))]
        results, failed = self._run(
            len(calls), lambda c: (c, names[calls[c][0]], responses[calls[c][1]],
                                   answers[calls[c][1]]), set(names))
        scores = {name: [0.0] * len(responses) for name in names}
        failures = []
        for c, (v, i) in enumerate(calls):
            if c in results:
                scores[names[v]][i] = results[c]
                continue
            kind, detail = failed[c]
            failures.append(Failure(kind, names[v], i, detail))
            scores[names[v]][i] = self.limits.score_of_failed(names[v])
        for f in failures:
            row = row_labels[f.index] if row_labels is not None else f"response {f.index} of the batch"
            what = "timed out" if f.kind != "error" else "failed"
            print(f"[rank {os.environ.get('RANK', '0')}] reward: verifier {f.verifier!r} {what} on "
                  f"{row} ({f.detail}); scored {scores[f.verifier][f.index]} (response "
                  f"{responses[f.index][:60]!r}, {len(responses[f.index])} characters)",
                  file=sys.stderr, flush=True)
        self._timeouts += sum(f.kind == "timeout" for f in failures)
        self._errors += sum(f.kind == "error" for f in failures)
        self._unresponsive += sum(f.kind == "unresponsive" for f in failures)
        return scores, failures

    # ---- the loop ----------------------------------------------------------------------
    def _run(self, n_calls: int, payload, needed: set[str]):
        """Run calls 0..n_calls-1: ({call: score}, {call: (kind, detail)})."""
        results: dict[int, float] = {}
        failed: dict[int, tuple[str, str]] = {}
        pending = collections.deque(range(n_calls))
        if n_calls:
            self._wait_until_ready()
        end = time.monotonic() + self.limits.batch_timeout_s
        while pending or self._running():
            now = time.monotonic()
            if now >= end:
                budget = (f"the batch ran past its budget of {self.limits.batch_timeout_s:g} s "
                          "(rl_config.reward_batch_timeout_s)")
                for worker in self._running():
                    failed[worker.task] = ("timeout", budget)
                    self._replace(worker)
                for call in pending:
                    failed[call] = ("timeout", budget + "; not started")
                break
            self._dispatch(pending, payload, needed)
            wake = min([end] + [w.deadline for w in self._running()]
                       + [w.started + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready])
            self._collect(wake - now, results, failed)
            self._expire(failed)
        return results, failed

    def _wait_until_ready(self) -> None:
        """Wait for starting workers. Not part of the batch budget: starting takes seconds
        (minutes on an overloaded node) once per job and after each kill, and a batch
        should neither pay for that nor score responses as failed for it."""
        end = time.monotonic() + _STARTUP_TIMEOUT_S
        while any(not w.ready for w in self._workers) and time.monotonic() < end:
            self._collect(end - time.monotonic(), {}, {})
            self._expire({})

    def _running(self) -> list[_Worker]:
        return [w for w in self._workers if w.task is not None]

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._modules)
        self.restarts += 1

    def _dispatch(self, pending, payload, needed: set[str]) -> None:
        for worker in list(self._workers):
            if not pending:
                return
            if not worker.ready or worker.task is not None:
                continue
            missing = needed - worker.registered
            if missing:
                name = sorted(missing)[0]
                raise RewardPoolError(
                    f"verifier {name!r} (from {get_verifier(name).__module__}) is not "
                    f"registered in a reward worker, which imports only {list(self._modules)}: "
                    "register it at the top level of an importable module, or score in the "
                    "training process with rl_config.reward_workers: 0")
            call = pending.popleft()
            if not worker.send(payload(call)):  # it died while idle: the call to its successor
                pending.appendleft(call)
                self._replace(worker)
                continue
            worker.task, worker.deadline = call, time.monotonic() + self.limits.call_timeout_s

    def _collect(self, timeout: float, results: dict, failed: dict) -> None:
        """Wait up to ``timeout`` s for replies, readiness or deaths, and record them."""
        watched = {}
        for worker in self._workers:
            if worker.task is not None or not worker.ready:
                watched[worker.conn] = worker  # EOF when the worker dies
        done = set()
        for handle in wait(list(watched), timeout=max(0.0, timeout)):
            worker = watched[handle]
            if worker not in done:
                done.add(worker)
                self._receive(worker, results, failed)

    def _receive(self, worker: _Worker, results: dict, failed: dict) -> None:
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message is None:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass  # closed its pipe but runs on: killed by _replace
            self._worker_died(worker, failed)
        elif message[0] == "failed":
            raise RewardPoolError(
                f"a reward worker could not import the verifiers' modules "
                f"{list(self._modules)}: {message[1]}")
        elif message[0] == "ready":
            worker.ready, worker.registered = True, set(message[1])
            self._startup_deaths = 0
        elif message[0] == worker.task:
            call, ok, value = message
            if ok:
                results[call] = value
            else:
                failed[call] = ("error", f"raised {value}")
            worker.task = None

    def _worker_died(self, worker: _Worker, failed: dict) -> None:
        how = _exit_text(worker.process.returncode)
        if worker.task is not None:
            failed[worker.task] = ("error", f"its reward worker died ({how})")
        elif not worker.ready:
            self._startup_deaths += 1
            if self._startup_deaths >= 3:
                raise RewardPoolError(f"reward workers die while starting ({how}), 3 in a row")
        self._replace(worker)

    def _expire(self, failed: dict) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                limit = f"rl_config.reward_timeout_s={self.limits.call_timeout_s:g} s"
                failed[worker.task] = (
                    ("timeout", f"ran past {limit} and was killed") if worker.took_request()
                    else ("unresponsive", f"its reward worker did not take the request within "
                                          f"{limit} (stopped or frozen?) and was killed"))
                self._replace(worker)
            elif not worker.ready and now >= worker.started + _STARTUP_TIMEOUT_S:
                self._replace(worker)  # a worker that never started: try a fresh one


def reward_pool_for(rl) -> RewardPool | None:
    """The job's pool for ``rl_config`` (None with ``reward_workers: 0``: in-process)."""
    workers = rl.reward_workers if rl.reward_workers is not None else default_workers()
    if workers == 0:
        return None
    return RewardPool(workers, RewardLimits.from_config(rl), rl.verifier_function)
