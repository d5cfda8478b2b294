"""Bad numbers never reach the weights: skip an optimizer step with a NaN/Inf loss or gradient.

Megatron's optimizer notices NaN/Inf only through an fp16 loss scaler; with fp32 or
bf16 training a NaN gradient is clipped (by a NaN norm) and applied, and every weight
becomes NaN. :class:`StepGuard` looks before the step: the loss terms of the rank's
micro-batches and every gradient buffer of the model, reduced to one flag over all
ranks (one tiny all-reduce), so every rank skips the same steps and the weights of all
shards stay as they were. Consecutive skips are counted; after
``rl_config.max_consecutive_skipped_steps`` in a row the run stops with
:class:`NonFiniteError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


def _grad_tensors(model) -> Iterable[torch.Tensor]:
    """The gradients the optimizer would apply: megatron DDP's contiguous grad buffers
    (one tensor per buffer), else each parameter's ``main_grad`` / ``grad``."""
    buffers = list(getattr(model, "buffers", None) or []) + \
        list(getattr(model, "expert_parallel_buffers", None) or [])
    if buffers and all(hasattr(b, "grad_data") for b in buffers):
        return [b.grad_data for b in buffers]
    grads = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    return grads


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, exactly as ``torch.isfinite(t).all()``.

    A NaN or an infinity in ``t`` makes its sum NaN or infinite (a non-finite partial sum
    stays non-finite), so a finite sum proves every element finite in one reading pass
    (0.02 s for 70 M fp32 values on one core, against 0.72 s for the elementwise test, which
    writes a mask as large as ``t``); only a non-finite sum, which finite values reach only
    by overflowing, is checked element by element.
    """
    if not t.numel() or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def nonfinite_reason(loss_terms: Iterable[float], model, group=None) -> str | None:
    """Collective over ``group`` (default: the world): why this step must be skipped on
    every rank — ``"loss"``, ``"gradient"`` — or None when every rank's numbers are finite.

    ``loss_terms``: this rank's loss values (e.g. the per-micro-batch sums); ``model``: the
    DDP-wrapped model whose gradients the optimizer is about to apply.
    """
    loss_bad = not all(math.isfinite(float(v)) for v in loss_terms)
    grad_bad = any(not all_finite(g) for g in _grad_tensors(model))
    flags = torch.tensor([int(loss_bad), int(grad_bad)], dtype=torch.int32)
    if dist.is_initialized():
        device = next(iter(_grad_tensors(model)), flags).device
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags[0].item():
        return "loss"
    if flags[1].item():
        return "gradient"
    return None


class StepGuard:
    """Counts skipped optimizer steps and stops after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int = 3) -> None:
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.skipped_since_pop = 0

    def should_skip(self, loss_terms: Iterable[float], model, group=None) -> bool:
        """Collective: True (on every rank) when this step must not touch the weights.

        Raises :class:`NonFiniteError` on the ``max_consecutive``-th skip in a row.
        """
        reason = nonfinite_reason(loss_terms, model, group)
        if reason is None:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped_since_pop += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"{self.consecutive} optimizer steps in a row had a NaN/Inf {reason} and were "
                f"skipped (rl_config.max_consecutive_skipped_steps={self.max_consecutive}); "
                "the weights are those before the first skip. Lower actor_config.lr, check the "
                "rewards and the data, or resume from the last checkpoint")
        return True

    def pop_skipped(self) -> int:
        """Steps skipped since the last call (the ``actor/skipped_steps`` metric)."""
        n, self.skipped_since_pop = self.skipped_since_pop, 0
        return n
