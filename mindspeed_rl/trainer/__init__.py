"""Trainers: the GRPO iteration and the megatron actor it updates."""

from mindspeed_rl.trainer.actor import MegatronActor, RowBatch, forward_logprobs
from mindspeed_rl.trainer.grpo import GRPOTrainer

__all__ = ["GRPOTrainer", "MegatronActor", "RowBatch", "forward_logprobs"]
