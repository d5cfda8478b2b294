"""Rollout: the actor's generation engine (vLLM in-process, SPMD)."""

from mindspeed_rl.rollout.vllm_engine import (Completion, RolloutConfigError, RolloutEngine,
                                         RolloutResult)

__all__ = ["Completion", "RolloutConfigError", "RolloutEngine", "RolloutResult"]
