"""Frozen roles in a layout of their own (the reference of MindSpeed-RL's separate-worker
configs, the distillation teacher): their log-probs of the training layout's rows, computed
under a second set of megatron groups over the same ranks
(``mindspeed_rl/parallel/second_layout.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.engine.actor import forward_logprobs
from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.reductions import counts_in_train_layout


def logprobs_in_own_layout(ctx: PhaseContext, model, swap, layout, vocab_size: int,
                           rows: RowBatch) -> list[torch.Tensor]:
    """A frozen role's log-probs of ``rows`` (this training-DP rank's) computed in the role's
    own layout (``layout``: a SecondLayout): every training-DP rank's rows gathered in DP
    order, each of the role's DP ranks takes its contiguous share, the shares' log-probs
    gathered back."""
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    dp_rank = ps.get_data_parallel_rank()
    mine = list(zip(rows.prompts, rows.responses))
    everyone = [None] * world
    dist.all_gather_object(everyone, (dp_rank, mine) if counts_in_train_layout() else None)
    flat = [(d, i, p, r) for d, part in sorted((e for e in everyone if e is not None),
                                               key=lambda e: e[0])
            for i, (p, r) in enumerate(part)]
    with layout.current(), swap.resident():
        t_rank, t_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        lo, hi = len(flat) * t_rank // t_size, len(flat) * (t_rank + 1) // t_size
        share = RowBatch([p for _, _, p, _ in flat[lo:hi]], [r for _, _, _, r in flat[lo:hi]],
                         {})
        logp, _ = forward_logprobs(model, share,
                                   ctx.batch.micro_batching[names.REFERENCE_MODEL],
                                   vocab_size, temperature=ctx.temperature)
        speaks = counts_in_train_layout()  # in the role's layout
    results = [None] * world
    dist.all_gather_object(results, (lo, [t.cpu() for t in logp]) if speaks else None)
    full: list = [None] * len(flat)
    for start, part in (r for r in results if r is not None):
        full[start:start + len(part)] = part
    return [full[k] for k, (d, _, _, _) in enumerate(flat) if d == dp_rank]
