"""Row metadata of one iteration, replicated on every rank of the TransferDock.

The controller never holds tensors. Each put publishes a small
:class:`PutRecord` per rank (exchanged by the dock's control collective); every
rank applies the same records in the same order, so the metadata — and every
decision computed from it (row ids, owners, which rows a get returns and to
whom) — is identical on every rank without a coordinator. The only thing a
rank's local view adds is which of those rows it physically holds (the warehouse).

Metadata is stored column-wise in numpy arrays indexed by row id (owner, element
count and shape of every cell; token length, group and taken flags of every
row), so applying a put or planning a get costs a few vectorised operations per
column rather than Python work per cell: every rank runs this control path on
every call, and on an oversubscribed host the ranks' Python time adds up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mindspeed_rl.errors import TransferDockError
from mindspeed_rl.transfer_dock.assignment import assign_units


def _int_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(frozen=True)
class PutRecord:
    """What one rank publishes about its part of a put (metadata only).

    Either ``num_new_rows`` > 0 (the rank creates rows; ids are allocated by the
    controller) or ``rows`` lists existing global row ids it writes columns for.
    ``columns`` maps a column name to ``(dtype name, shapes)`` with ``shapes`` a
    ``[num_rows, ndim]`` int64 array (one row per cell, in put order); sequences
    of shape tuples are accepted and converted.
    """

    num_new_rows: int = 0
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    columns: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    token_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # new rows
    num_rows_per_group: int = 1  # only for new rows
    # New rows only: held rows are delivered only to gets that name them (``candidates``)
    # until released; ``tags`` are small per-row ints every rank sees (e.g. a row's status).
    held: bool = False
    tags: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", _int_array(self.rows))
        object.__setattr__(self, "token_lengths", _int_array(self.token_lengths))
        object.__setattr__(self, "tags", {k: _int_array(v) for k, v in self.tags.items()})
        columns = {}
        for name, (dtype_name, shapes) in self.columns.items():
            shapes = np.asarray(shapes, dtype=np.int64)
            if shapes.ndim != 2:  # () shapes of scalars arrive as [n, 0]
                shapes = shapes.reshape(len(shapes), -1)
            columns[name] = (dtype_name, shapes)
        object.__setattr__(self, "columns", columns)


# The cells one put wrote to one column: (column, rows ascending, owner dock rank
# per row). The owner computed the cell and, in distributed mode, keeps it.
ColumnPlacement = tuple[str, np.ndarray, np.ndarray]


class RankSets:
    """Interned sets of dock ranks, so per-cell metadata can name a set by an int id.

    Id 0 is the empty set. Ids are stable for the life of the controller (the
    sets that occur — TP/PP peers of a DP rank, their unions — are few).
    """

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = [frozenset()]
        self._ids: dict[frozenset[int], int] = {frozenset(): 0}
        self._member: dict[int, np.ndarray] = {}  # rank -> [num sets] bool
        self._overlap: dict[tuple[tuple[int, ...], ...], np.ndarray] = {}

    def id_of(self, ranks) -> int:
        key = frozenset(int(r) for r in ranks)
        set_id = self._ids.get(key)
        if set_id is None:
            set_id = self._ids[key] = len(self.sets)
            self.sets.append(key)
        return set_id

    def contains(self, set_ids: np.ndarray, rank: int) -> np.ndarray:
        """Elementwise: does set ``set_ids[i]`` contain ``rank``."""
        member = self._member.get(rank)
        if member is None or len(member) < len(self.sets):
            member = self._member[rank] = np.array([rank in s for s in self.sets], dtype=bool)
        return member[set_ids]

    def overlap(self, ranks_per_group: Sequence[Sequence[int]]) -> np.ndarray:
        """``[num sets, num groups]`` int64: how many ranks of each group each set holds."""
        key = tuple(tuple(int(r) for r in g) for g in ranks_per_group)
        table = self._overlap.get(key)
        if table is None or len(table) < len(self.sets):
            table = self._overlap[key] = np.array(
                [[len(s.intersection(g)) for g in key] for s in self.sets],
                dtype=np.int64).reshape(len(self.sets), len(key))
        return table

    def union(self, set_ids: np.ndarray, ranks) -> np.ndarray:
        """Elementwise: the id of ``set_ids[i] | ranks``."""
        if len(set_ids) and (set_ids == set_ids.flat[0]).all():  # the common case
            return np.full_like(set_ids, self.id_of(self.sets[int(set_ids.flat[0])] | set(ranks)))
        unique, inverse = np.unique(set_ids, return_inverse=True)
        extra = frozenset(int(r) for r in ranks)
        return np.array([self.id_of(self.sets[i] | extra) for i in unique.tolist()],
                        dtype=np.int64)[inverse.reshape(-1)].reshape(set_ids.shape)


class _Column:
    """Per-row metadata of one column; ``owner == -1`` means not written yet.

    ``owner`` is the rank that serves the cell to ranks lacking it (the keeper
    among the ranks that computed it). ``reached`` (a :class:`RankSets` id) is
    every rank that computed the cell or received it from a get this
    iteration: the ranks that need no transfer to use it again.
    """

    def __init__(self, dtype: torch.dtype, ndim: int, num_rows: int) -> None:
        self.dtype = dtype
        self.ndim = ndim
        self.owner = np.full(num_rows, -1, dtype=np.int64)
        self.reached = np.zeros(num_rows, dtype=np.int64)
        self.numel = np.zeros(num_rows, dtype=np.int64)
        self.shape = np.zeros((num_rows, ndim), dtype=np.int64)

    def grow(self, num_rows: int) -> None:
        extra = num_rows - len(self.owner)
        if extra > 0:
            self.owner = np.concatenate([self.owner, np.full(extra, -1, dtype=np.int64)])
            self.reached = np.concatenate([self.reached, np.zeros(extra, dtype=np.int64)])
            self.numel = np.concatenate([self.numel, np.zeros(extra, dtype=np.int64)])
            self.shape = np.concatenate([self.shape, np.zeros((extra, self.ndim), np.int64)])

    def drop_leading(self, k: int) -> None:
        self.owner, self.reached = self.owner[k:], self.reached[k:]
        self.numel, self.shape = self.numel[k:], self.shape[k:]

    def nbytes(self, rows: np.ndarray) -> np.ndarray:
        return self.numel[rows] * self.dtype.itemsize

    @property
    def num_written(self) -> int:
        return int((self.owner >= 0).sum())


def dtype_from_name(name: str) -> torch.dtype:
    """``'torch.float32'`` or ``'float32'`` -> ``torch.float32``."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransferDockError(f"unknown dtype {name!r}")
    return dtype


# One rank's write of one column in a put: (rows, rank, [num_rows, ndim] shapes).
_Write = tuple[np.ndarray, int, np.ndarray]
# One column's cells of a put, placed: (column, rows ascending, owners, shapes,
# rank-set ids of the ranks that computed each cell).
_Placed = tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _writer_patterns(ranks: np.ndarray, unique_rows: np.ndarray, first: np.ndarray,
                     count: np.ndarray) -> tuple[list[list[int]], np.ndarray]:
    """The distinct sets of ranks that computed a cell, and which set each cell has.

    ``ranks`` are the writers of each cell sorted by row (``first``/``count``
    delimit each row's writers). Each distinct pattern is interned once by the
    caller, not once per row.
    """
    if len(unique_rows) == len(ranks):  # one writer per cell
        writer, inverse = np.unique(ranks, return_inverse=True)
        return [[w] for w in writer.tolist()], inverse
    if ranks.max() < 63:  # writer sets as bit masks: a 1-D unique
        masks, inverse = np.unique(np.bitwise_or.reduceat(
            np.left_shift(np.int64(1), ranks), first), return_inverse=True)
        return [[r for r in range(63) if m >> r & 1] for m in masks.tolist()], inverse
    per_row = np.full((len(unique_rows), int(count.max())), -1, dtype=np.int64)
    per_row[np.repeat(np.arange(len(unique_rows)), count),
            np.arange(len(ranks)) - np.repeat(first, count)] = ranks
    unique_patterns, inverse = np.unique(per_row, axis=0, return_inverse=True)
    return [p[p >= 0].tolist() for p in unique_patterns], inverse


class Controller:
    """Per-row metadata: owner rank per column, token length, group, taken flags.

    Ranks in arguments and results are dock ranks (0 .. dock size - 1).
    """

    def __init__(self) -> None:
        self.rank_sets = RankSets()
        # Rows are indexed locally: local row i is global row ``base + i``. Retiring the
        # oldest rows moves ``base`` forward and drops their metadata, so memory follows
        # the rows still held while global ids keep growing across iterations.
        self.base = 0
        self.num_rows = 0  # local rows (retired ones between live rows included)
        self.token_length = np.zeros(0, dtype=np.int64)
        self.group = np.zeros(0, dtype=np.int64)  # group id = local id of the group's first row
        self.live = np.zeros(0, dtype=bool)  # False once retired
        self.held = np.zeros(0, dtype=bool)  # True until released: only named gets see it
        self.tags: dict[str, np.ndarray] = {}  # replicated small ints per row (-1: unset)
        self.columns: dict[str, _Column] = {}
        self._taken: dict[str, np.ndarray] = {}

    @property
    def next_row_id(self) -> int:
        """The global id the next new row gets (ids never repeat)."""
        return self.base + self.num_rows

    @property
    def num_live_rows(self) -> int:
        return int(self.live.sum())

    def retire(self, rows: np.ndarray | None = None) -> int:
        """Retire local ``rows`` (all rows when None): they are never delivered again.

        Returns ``k``, how many leading local rows were dropped: local row ``i`` is now
        ``i - k`` (the caller renumbers what it keys by local row; ``base`` grew by k).
        """
        if rows is None:
            self.live[:] = False
        else:
            self.live[np.asarray(rows, dtype=np.int64)] = False
        alive = np.flatnonzero(self.live)
        k = int(alive[0]) if len(alive) else self.num_rows
        if k:
            self.base += k
            self.num_rows -= k
            self.token_length = self.token_length[k:]
            self.group = self.group[k:] - k
            self.live = self.live[k:]
            self.held = self.held[k:]
            self.tags = {name: values[k:] for name, values in self.tags.items()}
            for col in self.columns.values():
                col.drop_leading(k)
            self._taken = {c: t[k:] for c, t in self._taken.items()}
        if not self.num_rows:  # every row retired: column dtypes may change next time
            self.columns = {}
            self._taken = {}
            self.tags = {}
        return k

    def state_dict(self) -> dict:
        """The replicated metadata (identical on every rank), for checkpoints: tensors and
        plain values only, so it loads with ``torch.load(weights_only=True)``."""
        t = torch.from_numpy
        return {"base": self.base, "num_rows": self.num_rows,
                "token_length": t(self.token_length.copy()), "group": t(self.group.copy()),
                "live": t(self.live.copy()), "held": t(self.held.copy()),
                "tags": {name: t(values.copy()) for name, values in self.tags.items()},
                "rank_sets": [sorted(s) for s in self.rank_sets.sets],
                "taken": {c: t(m.copy()) for c, m in self._taken.items()},
                "columns": {name: [str(c.dtype), c.ndim, t(c.owner.copy()), t(c.reached.copy()),
                                   t(c.numel.copy()), t(c.shape.copy())]
                            for name, c in self.columns.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rank_sets = RankSets()
        for ranks in state["rank_sets"]:
            self.rank_sets.id_of(ranks)
        self.base, self.num_rows = int(state["base"]), int(state["num_rows"])
        self.token_length, self.group = state["token_length"].numpy(), state["group"].numpy()
        self.live = state["live"].numpy()
        # checkpoints written before rows could be held have neither entry
        self.held = state["held"].numpy() if "held" in state else np.zeros_like(self.live)
        self.tags = {name: values.numpy() for name, values in state.get("tags", {}).items()}
        self._taken = {c: m.numpy() for c, m in state["taken"].items()}
        self.columns = {}
        for name, (dtype, ndim, owner, reached, numel, shape) in state["columns"].items():
            col = self.columns[name] = _Column(dtype_from_name(dtype), ndim, 0)
            col.owner, col.reached = owner.numpy(), reached.numpy()
            col.numel, col.shape = numel.numpy(), shape.numpy()

    # ---- put -----------------------------------------------------------------
    def apply_put(self, record_per_rank: Sequence[PutRecord]) -> list[ColumnPlacement]:
        """Apply every rank's record of one put; return the cells written, per column
        (columns sorted by name, rows ascending), with their owners.

        Validates everything before changing any state, so a bad put raises the
        same error on every rank and leaves the metadata untouched: rows are
        allocated, each rank's writes checked, each column's cells placed, and only
        then is the put committed.
        """
        rows_per_rank, next_row = self._allocate_rows(record_per_rank)
        writers, kinds = self._check_writes(record_per_rank, rows_per_rank, next_row)
        placements = [self._place_column(name, writers[name])
                      for name in sorted(writers)]  # (column, row) order: the wire order of a put
        self._commit_rows(record_per_rank, rows_per_rank, next_row)
        return [self._commit_column(placement, kinds, next_row) for placement in placements]

    def _allocate_rows(self, record_per_rank: Sequence[PutRecord]
                       ) -> tuple[list[np.ndarray], int]:
        """The rows each rank writes (new ids, numbered in rank order, for ranks that
        create rows), and the row count after the put."""
        next_row = self.num_rows
        rows_per_rank: list[np.ndarray] = []
        for rank, rec in enumerate(record_per_rank):
            if rec.num_new_rows and len(rec.rows):
                raise TransferDockError(f"rank {rank}: a put either creates rows or writes "
                                        "existing rows, not both")
            if rec.num_new_rows % max(rec.num_rows_per_group, 1):
                raise TransferDockError(
                    f"rank {rank} put {rec.num_new_rows} new rows, not a multiple of "
                    f"num_rows_per_group={rec.num_rows_per_group}")
            if rec.num_new_rows:
                rows = np.arange(next_row, next_row + rec.num_new_rows, dtype=np.int64)
                next_row += rec.num_new_rows
            else:
                rows = rec.rows
            if rec.num_new_rows and len(rec.token_lengths) != rec.num_new_rows:
                raise TransferDockError(f"rank {rank} put {rec.num_new_rows} new rows with "
                                        f"{len(rec.token_lengths)} token lengths")
            for name, values in rec.tags.items():
                if len(values) != rec.num_new_rows:
                    raise TransferDockError(f"rank {rank} put {rec.num_new_rows} new rows with "
                                            f"{len(values)} values of tag {name!r}")
            rows_per_rank.append(rows)
        return rows_per_rank, next_row

    def _check_writes(self, record_per_rank: Sequence[PutRecord],
                      rows_per_rank: Sequence[np.ndarray], next_row: int
                      ) -> tuple[dict[str, list[_Write]], dict[str, tuple[torch.dtype, int]]]:
        """Check every rank's rows and cells; return the writes per column and every
        column's ``(dtype, ndim)`` (those it holds and those this put creates)."""
        writers: dict[str, list[_Write]] = {}
        kinds = {c: (col.dtype, col.ndim) for c, col in self.columns.items()}
        for rank, (rec, rows) in enumerate(zip(record_per_rank, rows_per_rank)):
            self._check_rows(rank, rows, next_row)
            for name, (dtype_name, shapes) in rec.columns.items():
                self._check_cells(rank, name, dtype_from_name(dtype_name), shapes, rows, kinds)
                writers.setdefault(name, []).append((rows, rank, shapes))
        return writers, kinds

    def _check_rows(self, rank: int, rows: np.ndarray, next_row: int) -> None:
        """``rank`` writes rows that exist (or this put creates), each once."""
        if len(rows) and (rows.min() < 0 or rows.max() >= next_row):
            bad = int(rows[(rows < 0) | (rows >= next_row)][0])
            raise TransferDockError(f"rank {rank} put row {bad + self.base}, which does "
                                    f"not exist (the dock holds rows {self.base} to "
                                    f"{self.next_row_id - 1})")
        if len(np.unique(rows)) != len(rows):
            raise TransferDockError(f"rank {rank} put the same row twice in one put")

    def _check_cells(self, rank: int, name: str, dtype: torch.dtype, shapes: np.ndarray,
                     rows: np.ndarray, kinds: dict[str, tuple[torch.dtype, int]]) -> None:
        """``rank``'s cells of column ``name``: the column's dtype and number of
        dimensions (recorded in ``kinds`` for a new column), one per row, none
        already written."""
        known_dtype, known_ndim = kinds.setdefault(name, (dtype, shapes.shape[1]))
        if known_dtype != dtype:
            raise TransferDockError(f"rank {rank} put column {name!r} as {dtype}, but it "
                                    f"holds {known_dtype}")
        if known_ndim != shapes.shape[1]:
            raise TransferDockError(
                f"rank {rank} put column {name!r} with {shapes.shape[1]}-D cells, but its "
                f"cells are {known_ndim}-D; every cell of a column has the same "
                "number of dimensions")
        if len(shapes) != len(rows):
            raise TransferDockError(f"rank {rank} put {len(shapes)} cells of column "
                                    f"{name!r} for {len(rows)} rows")
        col = self.columns.get(name)
        if col is not None:
            existing = rows[rows < len(col.owner)]
            written = existing[col.owner[existing] >= 0]
            if len(written):
                raise TransferDockError(
                    f"rank {rank} put column {name!r} of row "
                    f"{int(written.min()) + self.base}, which is already written")

    def _place_column(self, name: str, writes: Sequence[_Write]) -> _Placed:
        """One column's cells of a put: rows ascending, the owner (keeper) of each,
        its shape and the rank set that computed it."""
        rows = np.concatenate([r for r, _, _ in writes])
        ranks = np.concatenate([np.full(len(r), k, np.int64) for r, k, _ in writes])
        shapes = np.concatenate([s for _, _, s in writes])
        order = np.lexsort((ranks, rows))  # by row, then rank
        rows, ranks, shapes = rows[order], ranks[order], shapes[order]
        unique_rows, first, count = np.unique(rows, return_index=True, return_counts=True)
        if len(unique_rows) != len(rows):  # TP/PP peers offering the same cell
            self._check_same_shapes(name, rows, ranks, shapes, unique_rows, first, count)
        # Peers that computed the same cell all offer it (and all keep it); the
        # owner, who serves it to ranks lacking it, rotates by row so the sends
        # spread over them instead of piling onto the lowest rank.
        keeper = first + unique_rows % count
        patterns, inverse = _writer_patterns(ranks, unique_rows, first, count)
        producers = np.array([self.rank_sets.id_of(p) for p in patterns],
                             dtype=np.int64)[inverse.reshape(-1)]
        return name, unique_rows, ranks[keeper], shapes[keeper], producers

    def _check_same_shapes(self, name: str, rows: np.ndarray, ranks: np.ndarray,
                           shapes: np.ndarray, unique_rows: np.ndarray, first: np.ndarray,
                           count: np.ndarray) -> None:
        """Peers that put the same cell (``rows`` sorted, ``first``/``count`` of each
        unique row) agree on its shape."""
        differ = np.any(shapes != np.repeat(shapes[first], count, axis=0), axis=1)
        if differ.any():
            i = int(np.flatnonzero(differ)[0])
            j = first[np.searchsorted(unique_rows, rows[i])]
            raise TransferDockError(
                f"ranks {int(ranks[j])} and {int(ranks[i])} put column {name!r} of row "
                f"{int(rows[i]) + self.base} with different shapes {tuple(shapes[j].tolist())} "
                f"and {tuple(shapes[i].tolist())}")

    def _commit_rows(self, record_per_rank: Sequence[PutRecord],
                     rows_per_rank: Sequence[np.ndarray], next_row: int) -> None:
        """Record the new rows (token lengths, groups, live) and grow every column."""
        for rank, rec in enumerate(record_per_rank):
            if rec.num_new_rows:
                rows = rows_per_rank[rank]
                group = max(rec.num_rows_per_group, 1)
                self.token_length = np.concatenate([self.token_length, rec.token_lengths])
                self.group = np.concatenate([self.group, rows - (rows - rows[0]) % group])
                self.held = np.concatenate([self.held, np.full(len(rows), rec.held)])
                self._commit_tags(rec.tags, len(rows))
        self.live = np.concatenate([self.live, np.ones(next_row - self.num_rows, dtype=bool)])
        self.num_rows = next_row
        for col in self.columns.values():
            col.grow(next_row)

    def _commit_tags(self, tags: dict[str, np.ndarray], num_new: int) -> None:
        """Append the tags of ``num_new`` new rows (-1 where a put sets no such tag)."""
        before = len(self.held) - num_new
        for name in set(self.tags) | set(tags):
            old = self.tags.get(name, np.full(before, -1, dtype=np.int64))
            self.tags[name] = np.concatenate([old, tags.get(name, np.full(num_new, -1))])

    def release(self, rows: np.ndarray) -> None:
        """Held local ``rows`` become visible to every consumer."""
        self.held[rows] = False

    def _commit_column(self, placed: _Placed, kinds: dict[str, tuple[torch.dtype, int]],
                       num_rows: int) -> ColumnPlacement:
        """Record one column's placed cells (creating the column if new)."""
        name, rows, owners, shapes, producers = placed
        col = self.columns.get(name)
        if col is None:
            col = self.columns[name] = _Column(*kinds[name], num_rows)
        col.owner[rows] = owners
        col.reached[rows] = producers
        col.shape[rows] = shapes
        col.numel[rows] = shapes.prod(axis=1) if shapes.shape[1] else 1
        return name, rows, owners

    def new_rows_of(self, record_per_rank: Sequence[PutRecord], rank: int,
                    first_row: int) -> list[int]:
        """Global ids of the rows ``rank`` created in a put whose first new id was ``first_row``."""
        start = first_row + sum(rec.num_new_rows for rec in record_per_rank[:rank])
        return list(range(start, start + record_per_rank[rank].num_new_rows))

    # ---- cells ---------------------------------------------------------------
    def dtype(self, column: str) -> torch.dtype:
        return self.columns[column].dtype

    def owner(self, row: int, column: str) -> int:
        return int(self.columns[column].owner[row])

    def num_bytes(self, row: int, column: str) -> int:
        col = self.columns[column]
        return int(col.numel[row]) * col.dtype.itemsize

    # ---- get -----------------------------------------------------------------
    def plan_get(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
                 ranks_per_dp_rank: Sequence[Sequence[int]], whole_groups: bool = False,
                 candidates: np.ndarray | None = None) -> list[np.ndarray]:
        """Rows each DP rank of ``consumer`` receives (ascending row ids per DP rank).

        Takes the oldest ready rows not yet taken by ``consumer`` (whole groups
        when ``whole_groups``), balances them by token count and prefers the DP
        rank that already holds them. Raises :class:`TransferDockError` naming the
        consumer, columns and counts when the request can never be met: in SPMD
        every put that precedes this get is already published, so a shortfall
        now is a shortfall forever.

        With ``candidates`` (local row ids, in priority order; held rows included) only
        those rows are eligible, in that order, and the request is a bound: every DP rank
        receives at most ``rows_per_dp_rank`` of them (the ready ones, as evenly as the
        units allow).
        """
        num_dp_ranks = len(ranks_per_dp_rank)
        if rows_per_dp_rank < 0:
            raise TransferDockError(f"get for consumer {consumer!r}: rows_per_dp_rank="
                                    f"{rows_per_dp_rank} must be >= 0")
        if not columns:
            raise TransferDockError(f"get for consumer {consumer!r} names no columns")
        firsts, group_size = self._ready_units(consumer, columns, rows_per_dp_rank, whole_groups,
                                               candidates)
        units_per_dp_rank = rows_per_dp_rank // group_size
        num_units_needed = units_per_dp_rank * num_dp_ranks
        if candidates is not None:
            return self._plan_candidates(firsts, group_size, columns, ranks_per_dp_rank,
                                         units_per_dp_rank)
        if len(firsts) < num_units_needed:
            raise TransferDockError(self._shortfall_message(
                consumer, columns, rows_per_dp_rank, num_dp_ranks, len(firsts) * group_size,
                whole_groups))
        if num_units_needed == 0:  # nothing asked: no column needs to exist yet
            return [np.zeros(0, dtype=np.int64) for _ in range(num_dp_ranks)]
        # Oldest first (FIFO across gets); unit u is rows unit_rows[u].
        unit_rows = firsts[:num_units_needed, None] + np.arange(group_size)  # [units, size]
        unit_lengths = self.token_length[unit_rows].sum(axis=1)
        local = self._local_bytes(unit_rows, columns, ranks_per_dp_rank)
        units_per_bin = assign_units(unit_lengths.tolist(), local, num_dp_ranks,
                                     units_per_dp_rank)
        return [np.sort(unit_rows[list(units)].reshape(-1)) for units in units_per_bin]

    def _plan_candidates(self, firsts: np.ndarray, group_size: int, columns: Sequence[str],
                         ranks_per_dp_rank: Sequence[Sequence[int]], units_per_dp_rank: int
                         ) -> list[np.ndarray]:
        """``plan_get`` of named rows: up to ``units_per_dp_rank`` units per DP rank, the
        first ``firsts`` in priority order, balanced (empty units fill the bins)."""
        num_dp_ranks = len(ranks_per_dp_rank)
        firsts = firsts[:units_per_dp_rank * num_dp_ranks]
        if not len(firsts):
            return [np.zeros(0, dtype=np.int64) for _ in range(num_dp_ranks)]
        per_bin = -(-len(firsts) // num_dp_ranks)
        unit_rows = firsts[:, None] + np.arange(group_size)
        lengths = self.token_length[unit_rows].sum(axis=1).tolist()
        local = self._local_bytes(unit_rows, columns, ranks_per_dp_rank)
        empty = per_bin * num_dp_ranks - len(firsts)
        local = np.concatenate([local, np.zeros((empty, num_dp_ranks), dtype=np.int64)])
        units_per_bin = assign_units(lengths + [0] * empty, local, num_dp_ranks, per_bin)
        return [np.sort(unit_rows[[u for u in units if u < len(firsts)]].reshape(-1))
                for units in units_per_bin]

    def _ready_units(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
                     whole_groups: bool, candidates: np.ndarray | None = None
                     ) -> tuple[np.ndarray, int]:
        """The first row of every ready unit, oldest first (or in ``candidates`` order),
        and the unit's size: single rows, or with ``whole_groups`` the groups whose rows
        are all ready."""
        ready = self.ready_mask(consumer, columns, candidates)
        if not whole_groups:
            firsts = np.flatnonzero(ready)
            return firsts[self._order(firsts, candidates)], 1
        firsts, sizes = np.unique(self.group, return_counts=True)  # groups are contiguous
        group_ready = (np.logical_and.reduceat(ready, firsts) if len(firsts)
                       else np.zeros(0, bool))
        firsts, sizes = firsts[group_ready], sizes[group_ready]
        order = self._order(firsts, candidates)
        firsts, sizes = firsts[order], sizes[order]
        group_sizes = sorted(set(sizes.tolist()))
        if len(group_sizes) > 1:
            raise TransferDockError(
                f"get for consumer {consumer!r} asks for whole groups, but the ready groups "
                f"have different sizes {group_sizes}")
        group_size = group_sizes[0] if group_sizes else 1
        if rows_per_dp_rank % group_size:
            raise TransferDockError(
                f"get for consumer {consumer!r} asks for whole groups of {group_size} rows, "
                f"but rows_per_dp_rank={rows_per_dp_rank} is not a multiple of {group_size}")
        return firsts, group_size

    def _local_bytes(self, unit_rows: np.ndarray, columns: Sequence[str],
                     ranks_per_dp_rank: Sequence[Sequence[int]]) -> np.ndarray:
        """Locality: ``[units, DP ranks]`` bytes of each unit already in place at each
        DP rank, summed over its ranks (cells they computed or received in an earlier
        get)."""
        num_units, group_size = unit_rows.shape
        overlap = self.rank_sets.overlap(ranks_per_dp_rank)  # [sets, DP ranks]
        local = np.zeros((num_units, len(ranks_per_dp_rank)), dtype=np.int64)
        unit_of_cell = np.repeat(np.arange(num_units), group_size)
        for c in columns:
            col = self.columns[c]
            # Bytes per (unit, holder set) — few distinct sets — times each set's
            # ranks in each DP rank.
            sets, which = np.unique(col.reached[unit_rows].reshape(-1), return_inverse=True)
            per_set = np.bincount(unit_of_cell * len(sets) + which.reshape(-1),
                                  weights=col.nbytes(unit_rows).reshape(-1),
                                  minlength=num_units * len(sets))
            local += per_set.astype(np.int64).reshape(num_units, len(sets)) @ overlap[sets]
        return local

    def _taken_mask(self, consumer: str) -> np.ndarray:
        taken = self._taken.get(consumer)
        if taken is None or len(taken) < self.num_rows:
            grown = np.zeros(self.num_rows, dtype=bool)
            if taken is not None:
                grown[:len(taken)] = taken
            taken = self._taken[consumer] = grown
        return taken

    def _order(self, firsts: np.ndarray, candidates: np.ndarray | None) -> np.ndarray:
        """The permutation that puts ``firsts`` in the order of ``candidates`` (the
        identity without)."""
        if candidates is None:
            return np.arange(len(firsts))
        position = np.full(self.num_rows, len(candidates), dtype=np.int64)
        position[candidates[::-1]] = np.arange(len(candidates))[::-1]  # first mention wins
        return np.argsort(position[firsts], kind="stable")

    def ready_mask(self, consumer: str, columns: Sequence[str],
                   candidates: np.ndarray | None = None) -> np.ndarray:
        """``[num_rows]`` bool: ``columns`` all written and not taken by ``consumer``; not
        held, or, with ``candidates``, among them (held or not)."""
        if any(c not in self.columns for c in columns):
            return np.zeros(self.num_rows, dtype=bool)
        ready = ~self._taken_mask(consumer) & self.live
        if candidates is None:
            ready &= ~self.held
        else:
            named = np.zeros(self.num_rows, dtype=bool)
            named[candidates] = True
            ready &= named
        for c in columns:
            ready &= self.columns[c].owner >= 0
        return ready

    def mark_taken(self, consumer: str, rows: Sequence[int] | np.ndarray) -> None:
        """Record that ``consumer`` received ``rows`` (each row once per consumer)."""
        self._taken_mask(consumer)[np.asarray(rows, dtype=np.int64)] = True

    def mark_reached(self, columns: Sequence[str], rows: np.ndarray, ranks: Sequence[int]) -> None:
        """Record that ``ranks`` received the cells of ``columns`` in ``rows``."""
        for c in columns:
            col = self.columns[c]
            col.reached[rows] = self.rank_sets.union(col.reached[rows], ranks)

    def num_taken(self, consumer: str) -> int:
        return int(self._taken_mask(consumer).sum())

    def _shortfall_message(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
                           num_dp_ranks: int, num_eligible: int, whole_groups: bool) -> str:
        per_column = []
        for c in columns:
            if c not in self.columns:
                per_column.append(f"{c!r}: 0 ready (no rank has put this column)")
            else:
                per_column.append(f"{c!r}: {self.columns[c].num_written} ready")
        unit = "rows in whole groups" if whole_groups else "rows"
        return (
            f"get for consumer {consumer!r} can never be satisfied: it asks for "
            f"{rows_per_dp_rank} rows per DP rank x {num_dp_ranks} DP ranks = "
            f"{rows_per_dp_rank * num_dp_ranks} rows with columns {list(columns)}, but only "
            f"{num_eligible} {unit} are ready and not yet taken by {consumer!r}. "
            f"The dock holds {self.num_live_rows} rows; per column: {', '.join(per_column)}; "
            f"already taken by {consumer!r}: {self.num_taken(consumer)}. Every put before this "
            "get has been published, so waiting cannot help: put the missing column or ask "
            "for fewer rows.")
