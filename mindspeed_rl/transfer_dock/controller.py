"""Row metadata of one iteration, replicated on every rank of the TransferDock.

The controller never holds tensors. Each put publishes a small
:class:`PutRecord` per rank (all-gathered by the dock); every rank applies the
same records in the same order, so the metadata — and every decision computed
from it (row ids, owners, which rows a get returns and to whom) — is identical
on every rank without a coordinator. The only thing a rank's local view adds is
which of those rows it physically holds (the warehouse).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mindspeed_rl.transfer_dock.assignment import assign_units


class TransferDockError(RuntimeError):
    """A put or get that is inconsistent or can never be satisfied."""


@dataclass(frozen=True)
class PutRecord:
    """What one rank publishes about its part of a put (metadata only).

    Either ``num_new_rows`` > 0 (the rank creates rows; ids are allocated by the
    controller) or ``rows`` lists existing global row ids it writes columns for.
    """

    num_new_rows: int = 0
    rows: tuple[int, ...] = ()
    # column -> (dtype name, shape of each row in put order)
    columns: dict[str, tuple[str, tuple[tuple[int, ...], ...]]] = field(default_factory=dict)
    token_lengths: tuple[int, ...] = ()  # only for new rows
    num_rows_per_group: int = 1  # only for new rows


# One cell written by a put: (row, column, owner) where owner is the dock rank
# that computed it and, in distributed mode, keeps it. A plain tuple: puts
# create thousands of these.
ItemPlacement = tuple[int, str, int]


@dataclass
class _Column:
    dtype: torch.dtype
    owner_per_row: dict[int, int] = field(default_factory=dict)
    shape_per_row: dict[int, tuple[int, ...]] = field(default_factory=dict)
    numel_per_row: dict[int, int] = field(default_factory=dict)


def dtype_from_name(name: str) -> torch.dtype:
    """``'torch.float32'`` or ``'float32'`` -> ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferDockError(f"unknown dtype {name!r}")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class Controller:
    """Per-row metadata: owner rank per column, token length, group, taken flags.

    ``rank_of_dp_rank`` style arguments are dock ranks (0 .. dock size - 1).
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget every row (next iteration); row ids restart at 0."""
        self.num_rows = 0
        self.token_length_per_row: list[int] = []
        self.group_per_row: list[int] = []  # group id = first row id of the group
        self.rows_per_group: dict[int, list[int]] = {}
        self.columns: dict[str, _Column] = {}
        self.taken_per_consumer: dict[str, set[int]] = {}

    # ---- put -----------------------------------------------------------------
    def apply_put(self, record_per_rank: Sequence[PutRecord]) -> list[ItemPlacement]:
        """Apply every rank's record of one put; return the cells written, with owners,
        in (column, row) order.

        Validates everything before changing any state, so a bad put raises the
        same error on every rank and leaves the metadata untouched.
        """
        new_rows_per_rank: list[list[int]] = []
        next_row = self.num_rows
        for rank, rec in enumerate(record_per_rank):
            if rec.num_new_rows and rec.rows:
                raise TransferDockError(f"rank {rank}: a put either creates rows or writes "
                                        "existing rows, not both")
            if rec.num_new_rows % max(rec.num_rows_per_group, 1):
                raise TransferDockError(
                    f"rank {rank} put {rec.num_new_rows} new rows, not a multiple of "
                    f"num_rows_per_group={rec.num_rows_per_group}")
            new_rows_per_rank.append(list(range(next_row, next_row + rec.num_new_rows)))
            next_row += rec.num_new_rows

        # column -> row -> ranks offering the cell / its shape
        writers: dict[str, dict[int, list[int]]] = {}
        shape_of: dict[str, dict[int, tuple[int, ...]]] = {}
        dtype_of: dict[str, torch.dtype] = {c: col.dtype for c, col in self.columns.items()}
        for rank, rec in enumerate(record_per_rank):
            rows = new_rows_per_rank[rank] if rec.num_new_rows else list(rec.rows)
            if rows and (min(rows) < 0 or max(rows) >= next_row):
                bad = next(r for r in rows if not 0 <= r < next_row)
                raise TransferDockError(f"rank {rank} put row {bad}, which does not exist "
                                        f"(this iteration has {self.num_rows} rows)")
            if len(set(rows)) != len(rows):
                raise TransferDockError(f"rank {rank} put the same row twice in one put")
            for name, (dtype_name, shapes) in rec.columns.items():
                dtype = dtype_from_name(dtype_name)
                if dtype_of.setdefault(name, dtype) != dtype:
                    raise TransferDockError(f"rank {rank} put column {name!r} as {dtype}, but it "
                                            f"holds {dtype_of[name]}")
                existing = self.columns[name].owner_per_row if name in self.columns else {}
                clash = existing.keys() & set(rows)
                if clash:
                    raise TransferDockError(f"rank {rank} put column {name!r} of row {min(clash)}, "
                                            "which is already written this iteration")
                col_writers = writers.setdefault(name, {})
                col_shapes = shape_of.setdefault(name, {})
                for row, shape in zip(rows, shapes):
                    ranks = col_writers.get(row)
                    if ranks is None:
                        col_writers[row] = [rank]
                        col_shapes[row] = tuple(shape)
                    elif col_shapes[row] != tuple(shape):
                        raise TransferDockError(
                            f"ranks {ranks} and {rank} put column {name!r} of row {row} "
                            f"with different shapes {col_shapes[row]} and {tuple(shape)}")
                    else:
                        ranks.append(rank)

        # Valid: commit.
        for rank, rec in enumerate(record_per_rank):
            rows = new_rows_per_rank[rank]
            group = max(rec.num_rows_per_group, 1)
            for i, row in enumerate(rows):
                self.token_length_per_row.append(int(rec.token_lengths[i]))
                first = rows[i - i % group]
                self.group_per_row.append(first)
                self.rows_per_group.setdefault(first, []).append(row)
        self.num_rows = next_row
        placements = []
        for name in sorted(writers):  # (column, row) order: the wire order of a put
            col = self.columns.setdefault(name, _Column(dtype_of[name]))
            col_shapes = shape_of[name]
            for row, ranks in sorted(writers[name].items()):
                # Peers that computed the same cell all offer it; rotating the keeper
                # by row spreads storage (and later sends) over them instead of
                # piling everything onto the lowest rank.
                owner = ranks[row % len(ranks)]
                col.owner_per_row[row] = owner
                col.shape_per_row[row] = col_shapes[row]
                col.numel_per_row[row] = _numel(col_shapes[row])
                placements.append((row, name, owner))
        return placements

    def new_rows_of(self, record_per_rank: Sequence[PutRecord], rank: int,
                    first_row: int) -> list[int]:
        """Global ids of the rows ``rank`` created in a put whose first new id was ``first_row``."""
        start = first_row + sum(rec.num_new_rows for rec in record_per_rank[:rank])
        return list(range(start, start + record_per_rank[rank].num_new_rows))

    # ---- cells ---------------------------------------------------------------
    def dtype(self, column: str) -> torch.dtype:
        return self.columns[column].dtype

    def shape(self, row: int, column: str) -> tuple[int, ...]:
        return self.columns[column].shape_per_row[row]

    def owner(self, row: int, column: str) -> int:
        return self.columns[column].owner_per_row[row]

    def num_bytes(self, row: int, column: str) -> int:
        col = self.columns[column]
        return col.numel_per_row[row] * col.dtype.itemsize

    # ---- get -----------------------------------------------------------------
    def plan_get(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
                 ranks_per_dp_rank: Sequence[Sequence[int]], whole_groups: bool = False
                 ) -> list[list[int]]:
        """Rows each DP rank of ``consumer`` receives (ascending row ids per DP rank).

        Takes the oldest ready rows not yet taken by ``consumer`` (whole groups
        when ``whole_groups``), balances them by token count and prefers the DP
        rank that already holds them. Raises :class:`TransferDockError` naming the
        consumer, columns and counts when the request can never be met: in SPMD
        every put that precedes this get is already published, so a shortfall
        now is a shortfall forever.
        """
        num_dp_ranks = len(ranks_per_dp_rank)
        if rows_per_dp_rank < 0:
            raise TransferDockError(f"get for consumer {consumer!r}: rows_per_dp_rank="
                                    f"{rows_per_dp_rank} must be >= 0")
        if not columns:
            raise TransferDockError(f"get for consumer {consumer!r} names no columns")
        ready = self.ready_rows(consumer, columns)
        if whole_groups:
            ready_set = set(ready)
            units = [rows for first, rows in sorted(self.rows_per_group.items())
                     if all(r in ready_set for r in rows)]
            group_sizes = sorted({len(rows) for rows in units})
            if len(group_sizes) > 1:
                raise TransferDockError(
                    f"get for consumer {consumer!r} asks for whole groups, but the ready groups "
                    f"have different sizes {group_sizes}")
            group_size = group_sizes[0] if group_sizes else 1
            if rows_per_dp_rank % group_size:
                raise TransferDockError(
                    f"get for consumer {consumer!r} asks for whole groups of {group_size} rows, "
                    f"but rows_per_dp_rank={rows_per_dp_rank} is not a multiple of {group_size}")
        else:
            units = [[r] for r in ready]
            group_size = 1
        units_per_dp_rank = rows_per_dp_rank // group_size
        num_units_needed = units_per_dp_rank * num_dp_ranks
        if len(units) < num_units_needed:
            raise TransferDockError(self._shortfall_message(
                consumer, columns, rows_per_dp_rank, num_dp_ranks, len(units) * group_size,
                whole_groups))
        units = units[:num_units_needed]  # oldest first: FIFO across gets

        dp_of_rank = {rank: d for d, ranks in enumerate(ranks_per_dp_rank) for rank in ranks}
        unit_lengths = [sum(self.token_length_per_row[r] for r in rows) for rows in units]
        local_bytes_per_unit = []
        for rows in units:
            local: dict[int, int] = {}
            for r in rows:
                for c in columns:
                    d = dp_of_rank.get(self.columns[c].owner_per_row[r])
                    if d is not None:
                        local[d] = local.get(d, 0) + self.num_bytes(r, c)
            local_bytes_per_unit.append(local)
        units_per_bin = assign_units(unit_lengths, local_bytes_per_unit, num_dp_ranks,
                                     units_per_dp_rank)
        return [sorted(r for u in bin_units for r in units[u]) for bin_units in units_per_bin]

    def ready_rows(self, consumer: str, columns: Sequence[str]) -> list[int]:
        """Rows (ascending) whose ``columns`` are all written and ``consumer`` has not taken."""
        if any(c not in self.columns for c in columns):
            return []
        ready = set(self.columns[columns[0]].owner_per_row)
        for c in columns[1:]:
            ready &= self.columns[c].owner_per_row.keys()
        ready -= self.taken_per_consumer.get(consumer, set())
        return sorted(ready)

    def mark_taken(self, consumer: str, rows: Sequence[int]) -> None:
        """Record that ``consumer`` received ``rows`` (each row once per consumer)."""
        self.taken_per_consumer.setdefault(consumer, set()).update(rows)

    def _shortfall_message(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
                           num_dp_ranks: int, num_eligible: int, whole_groups: bool) -> str:
        taken = self.taken_per_consumer.get(consumer, set())
        per_column = []
        for c in columns:
            if c not in self.columns:
                per_column.append(f"{c!r}: 0 ready (no rank has put this column)")
            else:
                per_column.append(f"{c!r}: {len(self.columns[c].owner_per_row)} ready")
        unit = "rows in whole groups" if whole_groups else "rows"
        return (
            f"get for consumer {consumer!r} can never be satisfied: it asks for "
            f"{rows_per_dp_rank} rows per DP rank x {num_dp_ranks} DP ranks = "
            f"{rows_per_dp_rank * num_dp_ranks} rows with columns {list(columns)}, but only "
            f"{num_eligible} {unit} are ready and not yet taken by {consumer!r}. "
            f"This iteration holds {self.num_rows} rows; per column: {', '.join(per_column)}; "
            f"already taken by {consumer!r}: {len(taken)}. Every put before this get has been "
            "published, so waiting cannot help: put the missing column or ask for fewer rows.")
