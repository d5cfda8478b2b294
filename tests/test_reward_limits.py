"""Rewards on adversarial model output: every pattern finishes within the worker limit.

The inputs are benchmarks/bench_rewards.py's catalogue of the worst inputs constructed
for each pattern; the benchmark times them, these tests only assert that each call ends
within the per-call limit a reward worker gives a verifier call (10 s).
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest

from mindspeed_rl.rewards import get_verifier

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_rewards", ROOT / "benchmarks" / "bench_rewards.py")
bench_rewards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_rewards)

WORKER_LIMIT_S = 10.0
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
