"""Which tokens each context-parallel rank holds (pure index arithmetic, no processes)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.parallel.context_parallel import (cp_token_index, restore_token_order,
                                                    row_multiple, zigzag_index)


def test_zigzag_chunks_of_a_16_token_row():
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_index(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert zigzag_index(16, 4, 3).tolist() == [6, 7, 8, 9]
    # every token on exactly one rank
    held = torch.cat([zigzag_index(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))


def test_packed_rows_split_row_by_row():
    # rows of 8 and 16 tokens (already padded to 2 x CP = 4)
    assert cp_token_index([8, 16], 2, 0).tolist() == [0, 1, 6, 7,
                                                      8, 9, 10, 11, 20, 21, 22, 23]
    assert cp_token_index([8, 16], 2, 1).tolist() == [2, 3, 4, 5,
                                                      12, 13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("cp", [2, 4])
def test_restore_token_order_inverts_the_split(cp):
    segments = [8 * cp, 2 * cp, 4 * cp]
    values = torch.randn(sum(segments), 3)
    parts = [values[cp_token_index(segments, cp, r)] for r in range(cp)]
    assert all(len(p) == sum(segments) // cp for p in parts)
    assert torch.equal(restore_token_order(parts, segments), values)


def test_padding_multiples_and_errors():
    assert row_multiple(2) == 4 and row_multiple(2, sequence_parallel_tp=2) == 8
    with pytest.raises(ValueError, match="does not split into 2 x CP = 4 equal chunks"):
        zigzag_index(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 is not a rank of a CP group of 2"):
        zigzag_index(8, 2, 2)


@pytest.mark.parametrize("world,tp,cp,pp", [(8, 2, 2, 1), (8, 1, 2, 2), (16, 2, 2, 2)])
def test_cp_peers_of_a_dp_rank_get_its_rows(world, tp, cp, pp):
    """The TransferDock's training consumers: each DP rank's ranks are megatron's (its own
    rank generator, order tp-cp-ep-dp-pp), CP peers included."""
    from megatron.core.parallel_state import RankGenerator

    from mindspeed_rl.transfer_dock import ConsumerLayout

    layout = ConsumerLayout.megatron(world, tp, pp, cp)
    dp = world // (tp * cp * pp)
    ranks = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    # ranks sharing a DP index: everything but the dp dimension
    peers = sorted(sorted(g) for g in ranks.get_ranks("tp-cp-pp"))
    assert sorted(sorted(r) for r in layout.ranks_per_dp_rank) == peers
