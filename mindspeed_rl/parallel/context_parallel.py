"""Which tokens of a packed sequence each context-parallel rank holds (pure index arithmetic).

Context parallelism (CP) splits every sequence over the ``CP`` ranks of a CP group. Each
packed row, padded to a multiple of ``2 * CP``, is cut into ``2 * CP`` equal chunks and rank
``r`` holds chunks ``r`` and ``2 * CP - 1 - r`` (zig-zag). Under causal attention the early
chunks see few keys and the late ones many: pairing them balances the work of ring
attention (``megatron_cp_algo``). This is megatron-core's layout (``get_batch_on_this_cp_rank``,
per row here: its THD variant needs Transformer Engine), and the one megatron's packed
(THD) rotary embedding assumes under CP, so Ulysses (``ulysses_cp_algo``) uses it too: its
all-to-all gathers whole rows, which its attention puts back in order.

Every per-token tensor (tokens, positions, loss mask, advantages, log-probs...) is sliced
with the same index; :func:`restore_token_order` puts the ranks' results back.
"""

from __future__ import annotations

import torch

RING, ULYSSES = "megatron_cp_algo", "ulysses_cp_algo"  # context_parallel_algo values


def row_multiple(cp_size: int, sequence_parallel_tp: int = 1) -> int:
    """Each packed row is padded to a multiple of this: ``2 * CP`` chunks, times TP under
    sequence parallelism (each CP rank's share is split again over the TP ranks)."""
    return 2 * cp_size * sequence_parallel_tp


def zigzag_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions ``[length / CP]`` of one row that rank ``cp_rank`` holds, in order."""
    chunks = 2 * cp_size
    if length % chunks:
        raise ValueError(f"a row of {length} tokens does not split into 2 x CP = {chunks} "
                         "equal chunks: pad it to a multiple of row_multiple()")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a CP group of {cp_size}")
    size = length // chunks
    first, second = cp_rank * size, (chunks - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def cp_token_index(segments: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in the packed sequence (rows of lengths ``segments``, padding included)
    that ``cp_rank`` holds, in the order it holds them (row by row)."""
    starts = torch.tensor([0] + list(segments[:-1]), dtype=torch.long).cumsum(0).tolist()
    parts = [start + zigzag_index(n, cp_size, cp_rank) for start, n in zip(starts, segments)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def restore_token_order(per_rank: list[torch.Tensor], segments: list[int]) -> torch.Tensor:
    """The ranks' per-token results (``per_rank[r]``: ``[tokens of rank r, ...]``, e.g.
    gathered over the CP group) back in packed-sequence order ``[sum(segments), ...]``."""
    cp_size = len(per_rank)
    first = per_rank[0]
    out = first.new_empty((sum(segments),) + tuple(first.shape[1:]))
    for rank, values in enumerate(per_rank):
        out[cp_token_index(segments, cp_size, rank)] = values
    return out
