"""Which rows each DP rank of a consumer receives: pure, deterministic functions.

Every rank of the TransferDock calls these with the same replicated metadata and
therefore computes the same assignment without a coordinator. Nothing here
communicates or touches tensors, so it is unit-tested directly.

Vocabulary: a *unit* is what is assigned as a whole — one row, or one group of
``n_samples_per_prompt`` rows when a consumer asks for whole groups. A *bin* is
the set of units one DP rank receives; every bin receives exactly
``units_per_dp_rank`` units.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np


def token_spread(tokens_per_dp_rank: Sequence[int]) -> int:
    """max - min of the token counts of the DP ranks (0 is perfect balance)."""
    return max(tokens_per_dp_rank) - min(tokens_per_dp_rank) if tokens_per_dp_rank else 0


def tokens_per_bin(unit_lengths: Sequence[int],
                   units_per_bin: Sequence[Sequence[int]]) -> list[int]:
    """Token count of each bin."""
    return [sum(unit_lengths[u] for u in units) for units in units_per_bin]


def _check_sizes(num_units: int, num_dp_ranks: int, units_per_dp_rank: int) -> None:
    if num_dp_ranks < 1 or units_per_dp_rank < 0:
        raise ValueError(f"num_dp_ranks={num_dp_ranks} and units_per_dp_rank={units_per_dp_rank} "
                         "must be >= 1 and >= 0")
    if num_units != num_dp_ranks * units_per_dp_rank:
        raise ValueError(f"{num_units} units cannot fill {num_dp_ranks} DP ranks with exactly "
                         f"{units_per_dp_rank} units each")


# Locality of one unit: ``{dp_rank: bytes}`` or a per-DP-rank list of bytes.
UnitLocality = Mapping[int, int] | Sequence[int]


def _local_items(locality: UnitLocality) -> list[tuple[int, int]]:
    """``(dp_rank, bytes)`` pairs with bytes > 0, ascending by DP rank."""
    if isinstance(locality, Mapping):
        return sorted((d, n) for d, n in locality.items() if n > 0)
    return [(d, n) for d, n in enumerate(locality) if n > 0]


def _local_items_per_unit(local_bytes_per_unit: Sequence[UnitLocality] | np.ndarray
                          ) -> list[list[tuple[int, int]]]:
    """:func:`_local_items` of every unit; a ``[units, dp ranks]`` array in one pass
    over its non-zero entries (every rank runs this on every get)."""
    if not isinstance(local_bytes_per_unit, np.ndarray):
        return [_local_items(locality) for locality in local_bytes_per_unit]
    items: list[list[tuple[int, int]]] = [[] for _ in range(len(local_bytes_per_unit))]
    units, dps = np.nonzero(local_bytes_per_unit > 0)  # row-major: DP ranks ascending
    for u, d, n in zip(units.tolist(), dps.tolist(),
                       local_bytes_per_unit[units, dps].tolist()):
        items[u].append((d, n))
    return items


def _descending(unit_lengths: Sequence[int]) -> list[int]:
    # Longest first (LPT); equal lengths in index order so every rank sorts alike.
    return np.argsort(-np.asarray(unit_lengths, dtype=np.int64), kind="stable").tolist()


def greedy_balance(unit_lengths: Sequence[int], num_dp_ranks: int,
                   units_per_dp_rank: int) -> list[list[int]]:
    """Longest-processing-time greedy with a fixed number of units per bin.

    Units are taken longest first and each goes to the least-loaded bin that is
    not yet full (ties: lowest bin index). This is the reference ("optimal
    greedy") balance the TransferDock is held to. Returns unit indices per bin,
    each list ascending.
    """
    _check_sizes(len(unit_lengths), num_dp_ranks, units_per_dp_rank)
    bins: list[list[int]] = [[] for _ in range(num_dp_ranks)]
    # Heap of (load, bin) over bins that still have room.
    heap = [(0, b) for b in range(num_dp_ranks)] if units_per_dp_rank else []
    for u in _descending(unit_lengths):
        load, b = heapq.heappop(heap)
        bins[b].append(u)
        if len(bins[b]) < units_per_dp_rank:
            heapq.heappush(heap, (load + unit_lengths[u], b))
    return [sorted(units) for units in bins]


def _match_bins_to_dp_ranks(units_per_bin: list[list[int]],
                            local_bytes_per_unit: Sequence[UnitLocality] | np.ndarray
                            ) -> list[list[int]]:
    """Relabel balanced bins so that each lands on the DP rank holding most of its bytes.

    Bins are interchangeable for balance, so this keeps the token counts and only
    improves locality. Greedy over (local bytes, bin, dp rank) pairs, largest
    first; deterministic tie-break by index.
    """
    num_bins = len(units_per_bin)
    pairs = []
    local_items = _local_items_per_unit(local_bytes_per_unit)
    for b, units in enumerate(units_per_bin):
        local_per_dp: dict[int, int] = {}
        for u in units:
            for d, nbytes in local_items[u]:
                local_per_dp[d] = local_per_dp.get(d, 0) + nbytes
        pairs.extend((-nbytes, b, d) for d, nbytes in local_per_dp.items() if nbytes > 0)
    pairs.sort()
    dp_of_bin: dict[int, int] = {}
    taken_dp: set[int] = set()
    for _, b, d in pairs:
        if b not in dp_of_bin and d not in taken_dp:
            dp_of_bin[b] = d
            taken_dp.add(d)
    free_dp = iter(sorted(set(range(num_bins)) - taken_dp))
    result: list[list[int]] = [[] for _ in range(num_bins)]
    for b in range(num_bins):
        result[dp_of_bin[b] if b in dp_of_bin else next(free_dp)] = units_per_bin[b]
    return result


def assign_units(unit_lengths: Sequence[int],
                 local_bytes_per_unit: Sequence[UnitLocality] | np.ndarray,
                 num_dp_ranks: int, units_per_dp_rank: int,
                 tolerance: int | None = None) -> list[list[int]]:
    """Assign units to DP ranks: balanced by tokens, preferring units already local.

    Args:
        unit_lengths: token count of each unit.
        local_bytes_per_unit: for each unit, the bytes of it already in place at
            each DP rank (summed over the DP rank's TP/PP peers), as
            ``{dp_rank: bytes}`` (empty when no consumer rank holds it) or a
            list indexed by DP rank; or all units at once as a
            ``[units, dp ranks]`` int array.
        num_dp_ranks: number of bins.
        units_per_dp_rank: exact number of units per bin.
        tolerance: how many tokens above the least-loaded open bin a local bin may
            be and still be preferred; default half the longest unit.

    Returns:
        unit indices per DP rank, each list ascending.

    The locality-aware pass is LPT where a unit may go to a DP rank that holds it
    if that rank is within ``tolerance`` of the least-loaded open bin. Balance
    is guaranteed, not hoped for: if that pass ends further than one unit's
    length from the plain LPT result (in spread or in max load) the plain LPT
    bins are used instead, relabelled onto the DP ranks holding most of their
    bytes.
    """
    _check_sizes(len(unit_lengths), num_dp_ranks, units_per_dp_rank)
    if not unit_lengths:
        return [[] for _ in range(num_dp_ranks)]
    max_length = max(unit_lengths)
    if tolerance is None:
        tolerance = max_length // 2

    local_items = _local_items_per_unit(local_bytes_per_unit)
    loads = [0] * num_dp_ranks
    counts = [0] * num_dp_ranks
    bins: list[list[int]] = [[] for _ in range(num_dp_ranks)]
    heap = [(0, b) for b in range(num_dp_ranks)]  # lazy: stale entries are skipped
    for u in _descending(unit_lengths):
        while True:  # least-loaded open bin; drop stale or full entries
            load, b = heap[0]
            if load == loads[b] and counts[b] < units_per_dp_rank:
                break
            heapq.heappop(heap)
        choice, best_local, limit = b, 0, load + tolerance
        for d, nbytes in local_items[u]:
            if nbytes > best_local and counts[d] < units_per_dp_rank and loads[d] <= limit:
                choice, best_local = d, nbytes
        bins[choice].append(u)
        loads[choice] += unit_lengths[u]
        counts[choice] += 1
        if counts[choice] < units_per_dp_rank:
            heapq.heappush(heap, (loads[choice], choice))

    # Plain LPT's spread is >= 0 and its max load >= the mean, so within one unit
    # of those bounds is within one unit of LPT: no need to run it.
    if (token_spread(loads) <= max_length
            and max(loads) * num_dp_ranks <= sum(unit_lengths) + max_length * num_dp_ranks):
        return [sorted(units) for units in bins]
    reference = greedy_balance(unit_lengths, num_dp_ranks, units_per_dp_rank)
    ref_loads = tokens_per_bin(unit_lengths, reference)
    if (token_spread(loads) <= token_spread(ref_loads) + max_length
            and max(loads) <= max(ref_loads) + max_length):
        return [sorted(units) for units in bins]
    return _match_bins_to_dp_ranks(reference, local_bytes_per_unit)
