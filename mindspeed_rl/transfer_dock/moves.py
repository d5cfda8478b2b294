"""Which cells cross ranks in a put or a get: this rank's part of one plan.

Pure functions of the replicated metadata (the :class:`Controller`) and of the
dock's placement (``TransferDock._placement``, the one thing a mode defines:
which rank serves a cell and which ranks hold it). Every rank runs them on the
same metadata, so what rank ``a`` plans to send rank ``b`` is exactly what ``b``
plans to receive from ``a``; :func:`exchange.exchange_blocks` then moves it.
Blocks are ``{column: rows ascending}`` per peer, in (column, row) order: the
wire order both ends agree on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mindspeed_rl.transfer_dock.controller import ColumnPlacement, Controller

# (owners, had_copy, rank) -> (servers, held): see TransferDock._placement.
Placement = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


@dataclass
class Moves:
    """This rank's part of a put's or a get's data movement.

    ``outgoing[peer]`` / ``incoming[peer]``: the blocks this rank sends to /
    receives from each peer. ``local``: rows per column served from this rank's
    own cells (a get: delivered from its warehouse; a put: the cells it computed
    and keeps). ``any_remote``: whether any cell crosses ranks anywhere (the same
    verdict on every rank). ``own_bytes``: this rank's own share of a get's bytes.
    """

    outgoing: list[dict[str, np.ndarray]]
    incoming: list[dict[str, np.ndarray]]
    local: dict[str, np.ndarray] = field(default_factory=dict)
    any_remote: bool = False
    own_bytes: int = 0

    @classmethod
    def none(cls, size: int) -> "Moves":
        return cls([{} for _ in range(size)], [{} for _ in range(size)])


def put_moves(ctl: Controller, placements: Sequence[ColumnPlacement], rank: int, size: int,
              placement: Placement) -> Moves:
    """A put whose metadata ``ctl`` has applied: each cell's owner hands it to the
    rank that serves it when that is another rank; every rank that computed a
    cell and holds it (per ``placement``) and does not receive it keeps its own copy."""
    moves = Moves.none(size)
    for column, cell_rows, owners in placements:  # (column, row): the wire order
        computed = ctl.rank_sets.contains(ctl.columns[column].reached[cell_rows], rank)
        servers, held = placement(owners, computed, rank)
        handed = servers != owners
        receiving = handed & (servers == rank)
        kept = cell_rows[computed & held & ~receiving]
        if len(kept):
            moves.local[column] = kept
        if not handed.any():
            continue
        moves.any_remote = True
        for peer in range(size):
            send = cell_rows[handed & (owners == rank) & (servers == peer)]
            if len(send):
                moves.outgoing[peer][column] = send
            receive = cell_rows[receiving & (owners == peer)]
            if len(receive):
                moves.incoming[peer][column] = receive
    return moves


def get_moves(ctl: Controller, columns: Sequence[str], ranks_per_dp: Sequence[Sequence[int]],
              rows_per_dp: Sequence[np.ndarray], rank: int, size: int,
              placement: Placement) -> Moves:
    """A get that delivers ``rows_per_dp[d]`` to every rank of ``ranks_per_dp[d]``:
    each consumer rank receives the cells it does not hold from their servers.
    Vectorised over columns: every rank runs this on every get."""
    moves = Moves.none(size)
    metas = [ctl.columns[c] for c in columns]
    for ranks, rows in zip(ranks_per_dp, rows_per_dp):
        if not len(rows):
            continue
        owners = np.stack([meta.owner[rows] for meta in metas])  # [columns, rows]
        reached = np.stack([meta.reached[rows] for meta in metas])
        for dst in ranks:
            had = ctl.rank_sets.contains(reached, dst)
            moves.own_bytes += _own_bytes(metas, rows, owners, had, dst, rank)
            servers, held = placement(owners, had, dst)
            missing = ~held
            moves.any_remote = moves.any_remote or bool(missing.any())
            if dst == rank:
                _receive(moves, columns, rows, servers, missing)
            else:
                send = missing & (servers == rank)
                for i in np.flatnonzero(send.any(axis=1)).tolist():
                    moves.outgoing[dst][columns[i]] = rows[send[i]]
    return moves


def _own_bytes(metas, rows: np.ndarray, owners: np.ndarray, had: np.ndarray, dst: int,
               rank: int) -> int:
    """This rank's share of what any placement must move to ``dst``: cells ``dst``
    consumes for the first time that this rank computed, or (``dst`` is this rank)
    that it consumes for the first time."""
    first_time = ~had
    if dst != rank:
        first_time &= owners == rank
    return sum(int(metas[i].nbytes(rows[first_time[i]]).sum())
               for i in np.flatnonzero(first_time.any(axis=1)).tolist())


def _receive(moves: Moves, columns: Sequence[str], rows: np.ndarray, servers: np.ndarray,
             missing: np.ndarray) -> None:
    """This rank's own rows of a get: what it serves itself, what it receives from whom."""
    for i, col in enumerate(columns):
        if not missing[i].any():
            moves.local[col] = rows
            continue
        if not missing[i].all():
            moves.local[col] = rows[~missing[i]]
        for peer in np.unique(servers[i][missing[i]]).tolist():
            moves.incoming[peer][col] = rows[missing[i] & (servers[i] == peer)]
