"""Who receives a get's rows: the DP ranks of a consumer and their TP/PP peers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConsumerLayout:
    """How a consumer's ranks form DP ranks: ``ranks_per_dp_rank[d]`` are the
    global ranks (TP/PP peers) that all receive DP rank ``d``'s rows.

    Ranks of the dock not listed receive nothing from gets with this layout.
    """

    ranks_per_dp_rank: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        if not self.ranks_per_dp_rank:
            raise ValueError("a ConsumerLayout needs at least one DP rank")
        for d, ranks in enumerate(self.ranks_per_dp_rank):
            if not ranks:
                raise ValueError(f"DP rank {d} of the consumer layout has no ranks")
            if seen & set(ranks):
                raise ValueError(f"ranks {sorted(seen & set(ranks))} appear in two DP ranks")
            seen |= set(ranks)

    @property
    def num_dp_ranks(self) -> int:
        return len(self.ranks_per_dp_rank)

    @classmethod
    def megatron(cls, world_size: int, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1,
                 context_parallel_size: int = 1) -> "ConsumerLayout":
        """Megatron's default rank order (TP fastest, then CP, then DP, then PP); the CP
        peers of a DP rank receive its rows, as its TP/PP peers do."""
        tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
        if world_size % (tp * cp * pp):
            raise ValueError(f"world_size={world_size} is not divisible by TP={tp} x CP={cp} "
                             f"x PP={pp}")
        dp = world_size // (tp * cp * pp)
        return cls(tuple(
            tuple(p * tp * cp * dp + d * tp * cp + c * tp + t
                  for p in range(pp) for c in range(cp) for t in range(tp))
            for d in range(dp)))

    @classmethod
    def from_dp_groups(cls, dp_group_ranks_per_rank: Mapping[int, Sequence[int]]
                       ) -> "ConsumerLayout":
        """Build the layout from each rank's DP group: ``{global rank: its DP group's ranks}``.

        A rank's DP index is its position in its own DP group; ranks sharing an
        index are TP/PP peers of one DP rank.
        """
        sizes = {len(g) for g in dp_group_ranks_per_rank.values()}
        if len(sizes) != 1:
            raise ValueError(f"DP groups of different sizes {sorted(sizes)}")
        ranks_per_dp: list[list[int]] = [[] for _ in range(sizes.pop())]
        for rank, group_ranks in sorted(dp_group_ranks_per_rank.items()):
            if rank not in group_ranks:
                raise ValueError(f"rank {rank}'s dp_group {list(group_ranks)} does not contain it")
            ranks_per_dp[list(group_ranks).index(rank)].append(rank)
        return cls(tuple(tuple(r) for r in ranks_per_dp))
