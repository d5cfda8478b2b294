"""Which tokens of a packed sequence each context-parallel rank holds (pure index arithmetic).

Context parallelism (CP) splits every sequence over the ``CP`` ranks of a CP group:

* ``megatron_cp_algo`` (ring attention): each packed row, padded to a multiple of
  ``2 * CP``, is cut into ``2 * CP`` equal chunks and rank ``r`` holds chunks ``r`` and
  ``2 * CP - 1 - r`` (zig-zag). Under causal attention the early chunks see few keys and
  the late ones many: pairing them balances the work. The same layout as megatron-core's
  ``get_batch_on_this_cp_rank`` (per row here: its THD variant needs Transformer Engine).
* ``ulysses_cp_algo`` (all-to-all): rank ``r`` holds the ``r``-th contiguous ``1 / CP`` of
  the packed sequence; attention swaps sequence for head sharding and back, so which
  tokens a rank holds does not matter to it.

Every per-token tensor (tokens, positions, loss mask, advantages, log-probs...) is sliced
with the same index; :func:`restore_token_order` puts the ranks' results back.
"""

from __future__ import annotations

import torch

RING, ULYSSES = "megatron_cp_algo", "ulysses_cp_algo"
ALGORITHMS = (RING, ULYSSES)


def row_multiple(cp_size: int, algo: str, sequence_parallel_tp: int = 1) -> int:
    """Each packed row (ring) or the whole packed sequence (Ulysses) is padded to a
    multiple of this: ``2 * CP`` (ring) or ``CP`` (Ulysses), times TP under sequence
    parallelism (each CP rank's share is split again over the TP ranks)."""
    if algo not in ALGORITHMS:
        raise ValueError(f"context_parallel_algo={algo!r}: use one of {ALGORITHMS}")
    return (2 * cp_size if algo == RING else cp_size) * sequence_parallel_tp


def zigzag_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions ``[length / CP]`` of one row that ring rank ``cp_rank`` holds, in order."""
    chunks = 2 * cp_size
    if length % chunks:
        raise ValueError(f"a row of {length} tokens does not split into 2 x CP = {chunks} "
                         "equal chunks: pad it to a multiple of row_multiple()")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is not a rank of a CP group of {cp_size}")
    size = length // chunks
    first, second = cp_rank * size, (chunks - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def cp_token_index(segments: list[int], cp_size: int, cp_rank: int, algo: str) -> torch.Tensor:
    """Positions in the packed sequence (rows of lengths ``segments``, padding included)
    that ``cp_rank`` holds, in the order it holds them."""
    total = sum(segments)
    if algo == ULYSSES:
        if total % cp_size:
            raise ValueError(f"a packed sequence of {total} tokens does not split over "
                             f"CP = {cp_size} ranks: pad it to a multiple of row_multiple()")
        share = total // cp_size
        return torch.arange(cp_rank * share, (cp_rank + 1) * share)
    row_multiple(cp_size, algo)  # refuses an unknown algorithm
    starts = torch.tensor([0] + list(segments[:-1])).cumsum(0).tolist()
    return torch.cat([start + zigzag_index(n, cp_size, cp_rank)
                      for start, n in zip(starts, segments)] or [torch.zeros(0, dtype=torch.long)])


def restore_token_order(per_rank: list[torch.Tensor], segments: list[int],
                        algo: str) -> torch.Tensor:
    """The ranks' per-token results (``per_rank[r]``: ``[tokens of rank r, ...]``, e.g.
    gathered over the CP group) back in packed-sequence order ``[sum(segments), ...]``."""
    cp_size = len(per_rank)
    first = per_rank[0]
    out = first.new_empty((sum(segments),) + tuple(first.shape[1:]))
    for rank, values in enumerate(per_rank):
        out[cp_token_index(segments, cp_size, rank, algo)] = values
    return out
