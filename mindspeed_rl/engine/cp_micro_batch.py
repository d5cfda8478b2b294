"""A packed micro-batch under context parallelism: this CP rank's tokens in, whole rows out.

Each packed row is padded to a multiple of ``2 x CP`` (``x TP`` with sequence parallelism)
and every CP rank runs only its zig-zag chunks (`mindspeed_rl.parallel.context_parallel`)
through the model; megatron's packed (THD) rotary embedding gives each token the angle of
its place in its row, and the core attention (`mindspeed_rl.models.attention`) attends across
the CP group. The per-token outputs the losses read (log-probs, entropies) are computed on
the rank's own positions, all-gathered over the CP group (megatron's
``gather_from_sequence_parallel_region``: its backward reduce-scatters, so each rank's
gradient counts every CP rank's identical loss) and put back in token order, so the loss
code sees the ``[b, R]`` response tensors of the whole micro-batch, as without CP.

Every CP rank of a DP rank computes the same loss over the same units and returns them to
megatron, which sums the units over DP x CP: the CP-fold gradient of the gather and the
CP-fold unit count cancel, so each ``loss_agg_mode`` gives the CP = 1 gradient.
"""

from __future__ import annotations

from typing import Callable

import torch

from mindspeed_rl.engine.micro_batches import MicroBatch
from mindspeed_rl.parallel.context_parallel import cp_token_index
from mindspeed_rl.parallel.groups import context_parallel


class ContextParallelOutputs:
    """The last stage's logits of this CP rank's tokens ``[1, t, V/tp]``, read per response
    token of the whole micro-batch through :meth:`response_values`."""

    def __init__(self, logits: torch.Tensor, mb: MicroBatch, index: torch.Tensor) -> None:
        from megatron.core import parallel_state as ps

        self.logits = logits  # [1, t, V/tp]
        self.mb, self.index = mb, index
        self.group = ps.get_context_parallel_group()
        size = self.group.size()
        # packed position of each gathered token (rank 0's tokens, rank 1's, ...)
        order = torch.cat([cp_token_index(mb.segments, size, r) for r in range(size)])
        self.restore = torch.empty_like(order)
        self.restore[order] = torch.arange(len(order))
        # the token each local position predicts (the next one in its packed row)
        targets = torch.zeros_like(mb.tokens[0])
        targets[:-1] = mb.tokens[0, 1:]
        self.targets = targets[index].unsqueeze(0)  # [1, t]

    def response_values(self, per_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                        ) -> torch.Tensor:
        """``per_token(logits [1, t, V/tp], targets [1, t]) -> [1, t]`` on this rank's
        positions, gathered over CP, at the micro-batch's response positions ``[1, R]``."""
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        local = per_token(self.logits, self.targets)[0]  # [t]
        gathered = gather_from_sequence_parallel_region(local, True, self.group)  # [T]
        return gathered[self.restore][self.mb.response_index[0]].unsqueeze(0)  # [1, R]


def local_inputs(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, t], positions [1, t], index [t]) of this CP rank's zig-zag chunks."""
    if mb.segments is None:
        raise ValueError("context parallelism needs packed micro-batches")
    rank, size = context_parallel()
    index = cp_token_index(mb.segments, size, rank)
    return mb.tokens[:, index], mb.positions[:, index], index
