"""Helpers for the project's own tests: running a body on N gloo ranks."""

from mindspeed_rl.testing.multiprocess import RankFailure, free_port, run_on_ranks

__all__ = ["RankFailure", "free_port", "run_on_ranks"]
