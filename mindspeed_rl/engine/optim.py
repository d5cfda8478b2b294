"""A megatron model that trains: DDP, the megatron optimizer and its LR schedule.

The actor and the PPO critic are both a :class:`TrainableModel`; what differs is
their loss (``actor.py``, ``critic.py``). The optimizer keys are read straight
from the role's config section (``actor_config`` / ``critic_config``, both
``OptimizerKeys``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from mindspeed_rl.config.schema import OptimizerKeys
from mindspeed_rl.fault.nonfinite import StepGuard


class TrainableModel:
    """``model`` (this rank's GPTModel shard) wrapped in DDP with Adam and an LR schedule.

    Args:
        section: the role's config section (learning rate, decay, warmup, clipping, Adam).
        total_steps: optimizer steps of the whole run (the LR schedule's length).
        use_distributed_optimizer / bf16: ``megatron_training`` keys of the run.
    """

    def __init__(self, model, section: OptimizerKeys, *, total_steps: int,
                 use_distributed_optimizer: bool, bf16: bool,
                 max_consecutive_skipped_steps: int = 3) -> None:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import get_megatron_optimizer

        self.model = model
        config = model.config
        self.ddp = DistributedDataParallel(
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=use_distributed_optimizer))
        # Without these two hooks DP and sequence-parallel grads are silently not reduced.
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.ddp.no_sync
        self.optimizer = get_megatron_optimizer(
            _optimizer_config(section, bf16, config.params_dtype, use_distributed_optimizer),
            [self.ddp])
        self.scheduler = _lr_schedule(self.optimizer, section, total_steps)
        # NaN/Inf in the loss or a gradient: every rank skips the step (weights, optimizer
        # state and LR schedule unchanged); too many in a row stop the run.
        self.step_guard = StepGuard(max_consecutive_skipped_steps)

    @property
    def chunks(self) -> list:
        return [self.ddp]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, run_micro_batches: Callable[[], None],
             loss_terms: Callable[[], Iterable[float]]) -> dict[str, float]:
        """One optimizer step: zero the grads, ``run_micro_batches()`` (forward and
        backward through megatron's schedule), then, unless ``loss_terms()`` or a gradient
        is NaN/Inf on some rank, clip, step and advance the LR schedule."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model.train()
        run_micro_batches()
        if self.step_guard.should_skip(loss_terms(), self.ddp):
            ok, grad_norm = False, float("nan")
        else:
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "update_ok": float(bool(ok))}

    # ---- checkpoints -----------------------------------------------------------------
    def sharded_state_dict(self, *, loading: bool, with_optimizer: bool,
                           metadata: dict | None = None) -> dict:
        """Model (and optimizer) state for megatron's dist_checkpointing."""
        model_sd = self.model.sharded_state_dict()
        state = {"model": model_sd}
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_sd, is_loading=loading, metadata=metadata)
        return state

    def prepare_optimizer_for_load(self) -> None:
        """A fresh torch Adam has no state (no 'step') to load into: create it; the
        values are overwritten by the load (megatron does the same for FSDP)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values"):  # the sharded one;
                opt._init_optimizer_states_with_dummy_values()  # FP32Optimizer inits itself


def _optimizer_config(s: OptimizerKeys, bf16: bool, params_dtype, use_distributed_optimizer):
    """megatron-core's Adam settings from the role's section."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=s.lr, min_lr=s.min_lr,
                           weight_decay=s.weight_decay, adam_beta1=s.adam_beta1,
                           adam_beta2=s.adam_beta2, clip_grad=s.clip_grad, bf16=bf16,
                           params_dtype=params_dtype,
                           use_distributed_optimizer=use_distributed_optimizer)


def _lr_schedule(optimizer, s: OptimizerKeys, total_steps: int):
    """Linear warm-up over ``lr_warmup_fraction`` of the run's steps, then ``lr_decay_style``
    down to ``min_lr``; weight decay constant."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = int(s.lr_warmup_fraction * total_steps)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else s.lr, max_lr=s.lr, min_lr=s.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(total_steps, 1),
        lr_decay_style=s.lr_decay_style, start_wd=s.weight_decay, end_wd=s.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
