"""Reductions of per-rank values into metrics (every rank gets the same numbers)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_stats(name: str, values: list[float], counted: bool) -> dict[str, float]:
    """``{name/mean, name/min, name/max}`` over every rank's ``values`` (a rank whose
    values duplicate a peer's passes ``counted=False``)."""
    own = values if counted else []
    t = torch.tensor([sum(own), len(own), -min(own, default=math.inf),
                      max(own, default=-math.inf)], dtype=torch.float64)
    sums, extremes = t[:2].clone(), t[2:].clone()
    dist.all_reduce(sums)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return {f"{name}/mean": sums[0].item() / max(sums[1].item(), 1),
            f"{name}/min": -extremes[0].item(), f"{name}/max": extremes[1].item()}


def global_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def global_sums(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def counts_in_train_layout() -> bool:
    """Whether this rank speaks for its training DP rank (TP/CP/PP peers hold copies)."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.parallel.groups import context_parallel

    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
            and context_parallel()[0] == 0)
