"""Verifiers that misbehave as model output can make a real one misbehave, registered at
import (the reward workers import this module by name)."""

import os

from mindspeed_rl.rewards import register_verifier


@register_verifier("test_bigint_in_c", failed_score=-2.0)
def bigint_in_c(response: str, answer: str) -> float:
    """Hangs inside one C call (a huge power) on "power": SIGALRM cannot stop it."""
    if "power" in response:
        return float(7 ** 123456789 % 2)
    return 1.0


@register_verifier("test_raises")
def raises(response: str, answer: str) -> float:
    if "raise" in response:
        raise ValueError("a verifier bug on this response")
    return 1.0


@register_verifier("test_exits")
def exits(response: str, answer: str) -> float:
    """Kills its own process (a segfault, the OOM killer) on "exit"."""
    if "exit" in response:
        os._exit(3)
    return 1.0
