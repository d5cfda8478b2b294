"""Pure tests of the TransferDock's control functions (no processes, no tensors moved)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mindspeed_rl.transfer_dock.assignment import (assign_units, greedy_balance, token_spread,
                                                   tokens_per_bin)
from mindspeed_rl.transfer_dock import TransferDockError
from mindspeed_rl.transfer_dock.controller import Controller, PutRecord


def test_greedy_balance_fills_every_bin_exactly():
    lengths = [10, 1, 1, 1, 1, 1]
    bins = greedy_balance(lengths, num_dp_ranks=2, units_per_dp_rank=3)
    assert sorted(u for b in bins for u in b) == list(range(6))
    assert [len(b) for b in bins] == [3, 3]
    assert tokens_per_bin(lengths, bins) == [12, 3]  # the long row forces it


def test_greedy_balance_rejects_wrong_counts():
    with pytest.raises(ValueError, match="cannot fill"):
        greedy_balance([1, 2, 3], num_dp_ranks=2, units_per_dp_rank=2)


def test_assignment_prefers_local_units_when_balance_allows():
    # Equal lengths: balance is free, so every unit should stay where it lives.
    lengths = [100] * 8
    local = [{u % 4: 800} for u in range(8)]
    bins = assign_units(lengths, local, num_dp_ranks=4, units_per_dp_rank=2)
    for d, units in enumerate(bins):
        assert all(u % 4 == d for u in units)


def test_assignment_balance_within_one_unit_of_greedy_random():
    rng = random.Random(0)
    for _ in range(300):
        num_dp = rng.randint(1, 6)
        per_dp = rng.randint(0, 6)
        n = num_dp * per_dp
        lengths = [rng.randint(1, 4000) for _ in range(n)]
        # Skewed locality: most units live on DP rank 0, which tempts imbalance.
        local = [{0 if rng.random() < 0.7 else rng.randrange(num_dp): rng.randint(1, 10_000)}
                 for _ in range(n)]
        bins = assign_units(lengths, local, num_dp, per_dp)
        assert sorted(u for b in bins for u in b) == list(range(n))
        assert all(len(b) == per_dp for b in bins)
        if n:
            ref = tokens_per_bin(lengths, greedy_balance(lengths, num_dp, per_dp))
            got = tokens_per_bin(lengths, bins)
            assert token_spread(got) <= token_spread(ref) + max(lengths)
            assert max(got) <= max(ref) + max(lengths)
        assert bins == assign_units(lengths, local, num_dp, per_dp)  # deterministic
        # The same locality as per-DP-rank lists or as one [units, dp] array.
        dense = np.zeros((n, num_dp), dtype=np.int64)
        for u, loc in enumerate(local):
            for d, nbytes in loc.items():
                dense[u, d] = nbytes
        assert assign_units(lengths, dense.tolist(), num_dp, per_dp) == bins
        assert assign_units(lengths, dense, num_dp, per_dp) == bins


def _rollout(num_rows_per_rank, lengths, group=1):
    recs = []
    it = iter(lengths)
    for n in num_rows_per_rank:
        ls = [next(it) for _ in range(n)]
        recs.append(PutRecord(num_new_rows=n, columns={"ids": ("torch.int64", tuple((x,) for x in ls))},
                              token_lengths=tuple(ls), num_rows_per_group=group))
    return recs


def test_controller_row_ids_owners_and_groups():
    ctl = Controller()
    ctl.apply_put(_rollout([2, 4], [5, 6, 7, 8, 9, 10], group=2))
    assert ctl.num_rows == 6
    assert [ctl.owner(r, "ids") for r in range(6)] == [0, 0, 1, 1, 1, 1]
    assert ctl.group.tolist() == [0, 0, 2, 2, 4, 4]
    assert ctl.num_bytes(3, "ids") == 8 * 8
    # Both TP peers put the same result: one keeper per cell, rotating by row.
    shapes = tuple((1,) for _ in range(6))
    rec = PutRecord(rows=tuple(range(6)), columns={"lp": ("torch.float32", shapes)})
    placements = ctl.apply_put([rec, rec])
    [(column, rows, owners)] = placements
    assert column == "lp" and rows.tolist() == list(range(6))
    assert owners.tolist() == [0, 1, 0, 1, 0, 1]
    with pytest.raises(TransferDockError, match="already written"):
        ctl.apply_put([rec, PutRecord()])


def test_controller_whole_groups_stay_together():
    ctl = Controller()
    ctl.apply_put(_rollout([4, 4], [1, 2, 3, 4, 50, 60, 70, 80], group=4))
    rows = ctl.plan_get("adv", ["ids"], 4, [[0], [1]], whole_groups=True)
    assert sorted(map(tuple, rows)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    with pytest.raises(TransferDockError, match="not a multiple of 4"):
        ctl.plan_get("adv2", ["ids"], 2, [[0], [1]], whole_groups=True)


def test_controller_unsatisfiable_get_names_consumer_column_counts():
    ctl = Controller()
    ctl.apply_put(_rollout([3, 3], [4] * 6))
    with pytest.raises(TransferDockError) as err:
        ctl.plan_get("actor_train", ["ids"], 4, [[0], [1]])
    msg = str(err.value)
    assert "'actor_train'" in msg and "'ids'" in msg and "= 8 rows" in msg and "only 6" in msg
    with pytest.raises(TransferDockError) as err:
        ctl.plan_get("actor_train", ["ids", "logprobs_ref"], 1, [[0], [1]])
    assert "'logprobs_ref': 0 ready (no rank has put this column)" in str(err.value)
    # A failed get takes nothing; a satisfiable one takes rows exactly once.
    assert sum(map(len, ctl.plan_get("actor_train", ["ids"], 3, [[0], [1]]))) == 6
    ctl.mark_taken("actor_train", range(6))
    with pytest.raises(TransferDockError, match="already taken by 'actor_train': 6"):
        ctl.plan_get("actor_train", ["ids"], 1, [[0], [1]])


def test_controller_dtype_mismatch_is_rejected():
    ctl = Controller()
    ctl.apply_put(_rollout([1], [3]))
    bad = PutRecord(rows=(0,), columns={"ids": ("torch.float32", ((3,),))})
    with pytest.raises(TransferDockError, match="holds torch.int64"):
        ctl.apply_put([bad])
    assert ctl.dtype("ids") == torch.int64
