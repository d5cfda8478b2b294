"""TransferDock: the distributed sample flow (docs/transfer_dock.md).

SPMD: every rank of the dock's group calls ``put``, ``get`` and ``clear`` in the
same order. Control is metadata only: every get (and every put that creates
rows) starts with one small fixed-size all-to-all that checks the ranks agree on
the call and carries the put records published since the last one; every rank
applies the records to its replicated :class:`Controller` and so computes the
same row ids, owners and get assignments. Data moves once per (cell, consumer
rank), peer to peer, in one ``all_to_all_single`` per get, from the rank that
computed the cell to each rank of the receiving DP rank that lacks it. Results
are put back on the rank that computed them with no collective at all; ranks
keep what they computed or received, so later consumers reuse it.

That is the distributed mode (``distributed.py``). This module holds what every
mode shares; a mode (a subclass) defines one hook, :meth:`TransferDock._placement`:
which rank serves a cell and which ranks hold it (``centralized.py``: rank 0).

Typical GRPO use (every rank runs this)::

    dock = build_transfer_dock("distributed", timeout_s=600)
    rows = dock.put({"prompt_ids": p, "response_ids": r, "rewards": s},
                    num_rows_per_group=n_samples_per_prompt)     # rollout, gen-DP rank
    batch = dock.get("actor_logprobs", ["prompt_ids", "response_ids"],
                     rows_per_dp_rank=8, dp_group=train_layout)  # TP peers get the same rows
    dock.put({"logprobs_old": lp}, rows=batch.rows)              # stays here, no collective
    ...
    dock.clear()                                                 # next iteration
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from mindspeed_rl.errors import TransferDockError, TransferDockTimeoutError
from mindspeed_rl.transfer_dock import control
from mindspeed_rl.transfer_dock.batch import DockBatch, DockMetrics, in_row_order
from mindspeed_rl.transfer_dock.controller import ColumnPlacement, Controller, PutRecord
from mindspeed_rl.transfer_dock.exchange import ExchangeResult, exchange_blocks
from mindspeed_rl.transfer_dock.consumer_layout import ConsumerLayout
from mindspeed_rl.transfer_dock.moves import Moves, get_moves, put_moves
from mindspeed_rl.transfer_dock.warehouse import Warehouse

__all__ = ["ConsumerLayout", "DockBatch", "DockMetrics", "TransferDock",
           "TransferDockTimeoutError"]

# Cells of one put, by column, in the put's row order.
_Cells = list[tuple[str, list[torch.Tensor]]]


def _shapes(cells: Sequence[torch.Tensor], ndim: int) -> np.ndarray:
    """``[num_cells, ndim]`` int64 shapes of ``cells`` (all ``ndim``-D)."""
    if ndim == 1:
        return np.fromiter((c.numel() for c in cells), np.int64, len(cells))[:, None]
    return np.array([tuple(c.shape) for c in cells], dtype=np.int64).reshape(len(cells), ndim)


def _num_rows(columns: Mapping[str, list[torch.Tensor]]) -> int:
    """The rows of a put (every column has one cell per row)."""
    num_rows = {len(cells) for cells in columns.values()}
    if len(num_rows) > 1:
        raise TransferDockError(f"put columns have different row counts "
                                f"{ {n: len(c) for n, c in columns.items()} }")
    return num_rows.pop() if num_rows else 0


def _without_rows(record: PutRecord, cells: _Cells, retired: np.ndarray, shift: int
                  ) -> tuple[PutRecord, _Cells]:
    """A put of results not yet published, minus the ``retired`` rows, renumbered by
    ``shift`` (the record stays, possibly empty: ranks pair puts by their order)."""
    keep = ~np.isin(record.rows, retired)
    index = np.flatnonzero(keep).tolist()
    columns = {name: (dtype, shapes[keep]) for name, (dtype, shapes) in record.columns.items()}
    return (PutRecord(rows=record.rows[keep] - shift, columns=columns),
            [(name, [c[i] for i in index]) for name, c in cells])




class TransferDock:
    """Replay buffer of an iteration: replicated metadata, per-rank warehouses, P2P data.

    Args:
        group: the ranks that take part (default: the world). Every rank of the
            world must construct the dock (it creates its own process groups).
        timeout_s: bound on every dock collective; a rank that does not reach
            the same call in time makes the others raise
            :class:`TransferDockTimeoutError` instead of hanging. ``None``: the
            job's ``rl_config.collective_timeout_s``
            (:func:`mindspeed_rl.parallel.groups.collective_timeout_s`).
        device: where cells are kept, gets deliver them and transfer buffers
            live (a put moves cells that are elsewhere). Default: the host for a
            gloo data group, else the current accelerator.
        data_backend: backend of the data group (default: the group's backend;
            "nccl"/"hccl" move device tensors, "gloo" host tensors). Metadata
            always travels over gloo.
        eager_bytes: metadata a rank can publish inside the control collective
            (per call); larger puts take one more all-to-all.

    A mode is a subclass that implements :meth:`_placement`
    (:class:`~mindspeed_rl.transfer_dock.DistributedTransferDock`, the default, and
    ``CentralizedTransferDock``); :func:`build_transfer_dock` picks one by name. The base
    class knows none of its modes, so it is not built directly.
    """

    mode: str  # each mode's name, as build_transfer_dock knows it

    def __new__(cls, *args, **kwargs):
        if cls is TransferDock:
            raise TypeError("TransferDock is the base of the dock's modes: build one with "
                            "build_transfer_dock(mode, ...) or DistributedTransferDock(...)")
        return super().__new__(cls)

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout_s: float | None = None,
                 device: torch.device | str | None = None, data_backend: str | None = None,
                 eager_bytes: int = 16384) -> None:
        if not dist.is_initialized():
            raise TransferDockError("TransferDock needs torch.distributed to be initialised")
        if timeout_s is None:
            from mindspeed_rl.parallel.groups import collective_timeout_s

            timeout_s = collective_timeout_s()
        self.timeout_s = float(timeout_s)
        self.eager_bytes = int(eager_bytes)
        self._global_ranks: list[int] = (dist.get_process_group_ranks(group) if group is not None
                                         else list(range(dist.get_world_size())))
        self._dock_rank_of_global = {g: i for i, g in enumerate(self._global_ranks)}
        self.size = len(self._global_ranks)
        global_rank = dist.get_rank()
        self.rank = self._dock_rank_of_global.get(global_rank, -1)
        if self.rank < 0:
            raise TransferDockError(f"rank {global_rank} is not in the dock's group "
                                    f"{self._global_ranks}")
        self._make_groups(group, data_backend, device)
        self.controller = Controller()
        self.warehouse = Warehouse()
        self._num_calls = 0
        self._num_clears = 0
        # Puts of results not yet published: (record, [(column, cells of record.rows)]).
        self._pending: list[tuple[PutRecord, _Cells]] = []
        self.metrics = DockMetrics()

    def _make_groups(self, group: dist.ProcessGroup | None, data_backend: str | None,
                     device: torch.device | str | None) -> None:
        """The dock's own process groups (metadata over gloo; data over the data
        backend) and its device."""
        from mindspeed_rl.parallel.groups import new_group

        # Own groups, so the dock's timeout bounds its waits whatever the caller's
        # groups use (at least the start-up bound while the job starts); new_group is
        # collective over the world.
        self._meta_group = new_group(self._global_ranks, timeout_s=self.timeout_s, backend="gloo")
        backend = data_backend or dist.get_backend(group)
        if str(backend).lower() == "gloo":
            self._data_group = self._meta_group
            self.device = torch.device(device or "cpu")
        else:
            self._data_group = new_group(self._global_ranks, timeout_s=self.timeout_s,
                                         backend=backend)
            if device is None:
                acc = torch.accelerator.current_accelerator()
                device = torch.device(acc.type, torch.accelerator.current_device_index())
            self.device = torch.device(device)

    # ---- the mode's hook ------------------------------------------------------------
    def _placement(self, owners: np.ndarray, had_copy: np.ndarray, rank: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Where cells live: the one thing a mode defines.

        For cells (elementwise over arrays of any shape) whose owners are
        ``owners`` (the dock rank that computed each and keeps it) and of which
        ``rank`` has had a copy where ``had_copy`` (it computed the cell or a get
        delivered it), return ``(servers, held)``: the dock rank that serves each
        cell to ranks lacking it, and whether ``rank`` holds it. Everything else
        follows (``moves.py``): a put hands each cell from its owner to its server
        when they differ, a get sends each consumer rank the cells it does not
        hold from their servers, and a rank keeps the cells it holds.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define _placement")

    def _results_stay_put(self) -> bool:
        """Whether every rank serves and holds the cells it computes: then a put of
        results moves nothing, and its metadata can wait for the next control
        collective (no collective of its own)."""
        one, true = np.zeros(1, np.int64), np.ones(1, bool)
        for rank in range(self.size):
            servers, held = self._placement(one + rank, true, rank)
            if servers[0] != rank or not held[0]:
                return False
        return True

    # ---- collectives ------------------------------------------------------------
    @contextlib.contextmanager
    def _bounded(self, what: str) -> Iterator[None]:
        try:
            yield
        except TransferDockError:
            raise
        except RuntimeError as e:  # gloo/NCCL timeouts and peer failures
            error = TransferDockTimeoutError(
                f"{what}: the collective failed or did not complete within timeout_s="
                f"{self.timeout_s:g}; every rank of the dock must make the same put/get/clear "
                f"calls in the same order ({type(e).__name__}: {e})")
            error.call = what  # e.g. "get for consumer 'actor_update_0'", for fault reports
            raise error from e

    def _all_to_all(self, recv: torch.Tensor, send: torch.Tensor, what: str,
                    recv_splits: list[int] | None = None,
                    send_splits: list[int] | None = None) -> None:
        self.metrics.num_collectives += 1
        with self._bounded(what):
            dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits, group=self._meta_group)

    def _control(self, op: str, what: str, args: tuple, dp_key: Sequence[int] = (),
                 payload: object = None) -> tuple[list[tuple[int, ...]], list[object]]:
        """The dock's control collective: check the call, share small metadata.

        Every put and get starts with one fixed-size ``all_to_all_single`` over
        gloo in which each rank sends every peer the same block (``control.py``):
        a header naming the call, ``dp_key``, and up to ``eager_bytes`` of pickled
        metadata. Ranks that disagree on the call are caught here, by the headers,
        and never reach a transfer whose sizes do not match (which gloo answers by
        aborting the process). Metadata larger than ``eager_bytes`` follows in a
        second all-to-all sized from the headers. An all-to-all rather than an
        all-gather: gloo sends it in one round of direct messages instead of a
        ring of size - 1 steps (1.3 vs 3.8 ms at 4 ranks on 2 cores).
        The records of puts of results made since the last control collective
        (``self._pending``, see :meth:`put`) ride along and are applied first,
        in call order, on every rank. Returns every rank's ``dp_key`` and payload.
        """
        self._num_calls += 1
        blob = pickle.dumps(([record for record, _ in self._pending], payload),
                            protocol=pickle.HIGHEST_PROTOCOL)
        block = control.pack_block(op, self._num_calls, self._num_clears, args, dp_key, blob,
                                   self.size, self.eager_bytes)
        recv = torch.empty(self.size * block.numel(), dtype=torch.uint8)
        self._all_to_all(recv, block.repeat(self.size), what)
        headers, blobs = control.unpack_blocks(recv.view(self.size, -1), self.eager_bytes)
        control.check_same_call(headers, self._global_ranks, what)
        blobs = self._overflow(blobs, [h[4] for h in headers], blob, what)
        pending_per_rank, payloads = zip(*(pickle.loads(b) for b in blobs))
        self._publish_pending(pending_per_rank, what)
        return control.dp_keys_of(headers), list(payloads)

    def _overflow(self, blobs: list[bytes | None], sizes: list[int], blob: bytes, what: str
                  ) -> list[bytes]:
        """Fill in the metadata that did not fit a control block: one more all-to-all."""
        overflow = [n if n > self.eager_bytes else 0 for n in sizes]
        if not any(overflow):  # every rank sees the same sizes, so all take this branch
            return blobs
        mine = overflow[self.rank]
        send = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).repeat(self.size)
                if mine else torch.empty(0, dtype=torch.uint8))
        big = torch.empty(sum(overflow), dtype=torch.uint8)
        self._all_to_all(big, send, what, recv_splits=overflow, send_splits=[mine] * self.size)
        for r, piece in enumerate(big.split(overflow)):
            if overflow[r]:
                blobs[r] = piece.numpy().tobytes()
        return blobs

    def _publish_pending(self, pending_per_rank: Sequence[Sequence[PutRecord]], what: str
                         ) -> None:
        """Apply every rank's puts of results since the last control collective, in
        call order, and store this rank's cells of them."""
        mine, self._pending = self._pending, []
        for k, records in enumerate(zip(*pending_per_rank)):
            try:
                placements = self.controller.apply_put(records)
            except TransferDockError as e:  # this put and later ones are dropped
                raise TransferDockError(
                    f"a put of results published with this {what} (put {k + 1} of "
                    f"{len(mine)} since the last get): {e}") from None
            record, cells = mine[k]
            self._store(dict(cells), record.rows.tolist(), placements)

    # ---- data movement ------------------------------------------------------------
    def _exchange(self, moves: Moves, read_cells, what: str) -> ExchangeResult:
        if not moves.any_remote:  # every rank reaches the same verdict from the metadata
            return ExchangeResult({}, 0, 0)
        self.metrics.num_collectives += 1
        return exchange_blocks(
            moves.outgoing, moves.incoming, read_cells=read_cells,
            columns=self.controller.columns, group=self._data_group, device=self.device,
            timeout_context=lambda: self._bounded(what))

    def _store(self, columns: Mapping[str, list[torch.Tensor]], my_rows: list[int],
               placements: Sequence[ColumnPlacement]) -> ExchangeResult:
        """Put this rank's cells of a put (``columns[c][i]`` is row ``my_rows[i]``)
        where the placement says they live: keep what it holds, hand the rest over."""
        position = {row: i for i, row in enumerate(my_rows)}

        def local_cells(column: str, cell_rows: np.ndarray) -> list[torch.Tensor]:
            cells = columns[column]
            return [cells[position[r]] for r in cell_rows.tolist()]

        moves = put_moves(self.controller, placements, self.rank, self.size, self._placement)
        for column, kept in moves.local.items():
            self.warehouse.write_many(column, kept.tolist(), local_cells(column, kept))
        result = self._exchange(moves, local_cells, "put (moving cells to their home rank)")
        self._keep(result.received)
        return result

    def _keep(self, received: Mapping[str, Sequence[tuple[np.ndarray, Sequence[torch.Tensor]]]]
              ) -> None:
        """Store the cells this rank received that it holds per the placement."""
        for name, parts in received.items():
            owner = self.controller.columns[name].owner
            for rows, cells in parts:
                _, held = self._placement(owner[rows], np.ones(len(rows), bool), self.rank)
                if held.all():
                    self.warehouse.write_many(name, rows.tolist(), cells)
                elif held.any():
                    index = np.flatnonzero(held).tolist()
                    self.warehouse.write_many(name, rows[held].tolist(),
                                              [cells[i] for i in index])

    # ---- public API ---------------------------------------------------------------
    def put(self, columns: Mapping[str, Sequence[torch.Tensor]], rows: Sequence[int] | None = None,
            *, token_lengths: Sequence[int] | None = None,
            num_rows_per_group: int = 1, held: bool = False,
            tags: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """Write cells into this rank's warehouse and publish their metadata.

        Every rank of the dock makes each put call, alike in kind: a put that
        creates rows (``rows=None``; a rank with nothing to add puts ``{}``) is a
        collective that publishes at once, since it returns the new row ids; a
        put of results for existing rows (``rows=[...]``; a rank with no results
        passes ``rows=[]``) needs no collective in distributed mode: the cells
        stay here and their metadata rides with the next get (or rows put), which
        applies it before planning. Ranks that mix the two kinds in one call are
        caught by that next collective.

        Args:
            columns: ``name -> one tensor per row`` (e.g. ``[num_tokens]`` int64 ids,
                float32 log-probs, or ``[]`` scalars); rows may differ in length,
                but every cell of a column has the same dtype and number of dims.
            rows: global ids of existing rows (results of a get); ``None`` creates
                new rows, numbered after every row so far in rank order.
            token_lengths: per new row, the token count balancing uses; default
                the total elements of the integer (token-id) columns.
            num_rows_per_group: new rows form consecutive groups of this size
                (``n_samples_per_prompt``) that ``get(..., whole_groups=True)`` keeps together.
            held: new rows are held: only a get that names them (``candidates``)
                delivers them, until :meth:`release` (partial rollout keeps unfinished
                responses this way).
            tags: per new row, small integers every rank sees afterwards (:meth:`tags`).

        Returns:
            the global row ids written by this rank, in put order.

        TP/PP peers that computed the same cells may all put them: one of them
        keeps each cell (rotating by row), so nothing is stored twice.
        """
        start = time.perf_counter()
        columns = {name: list(cells) for name, cells in columns.items()}
        num_rows_local = _num_rows(columns)
        base = self.controller.base
        if rows is not None:
            rows = self._local_rows(rows, num_rows_local)
        columns = self._on_device(columns)
        record = self._put_record(columns, rows, token_lengths, num_rows_per_group)
        if held or tags:
            if rows is not None:
                raise TransferDockError("held and tags are for new rows (rows=None)")
            record = dataclasses.replace(record, held=held, tags=dict(tags or {}))
        if rows is not None and self._results_stay_put():
            # A put of results: the cells stay here and their metadata rides with
            # the next control collective, so this put needs no collective at all.
            # They enter the warehouse when that collective has validated them.
            self._num_calls += 1
            self._pending.append((record, list(columns.items())))
            my_rows, result = list(rows), ExchangeResult({}, 0, 0)
        else:
            _, records = self._control("put", "put", (), payload=record)
            first_new_row = self.controller.num_rows
            placements = self.controller.apply_put(records)
            my_rows = (list(rows) if rows is not None
                       else self.controller.new_rows_of(records, self.rank, first_new_row))
            result = self._store(columns, my_rows, placements)
        m = self.metrics
        m.num_puts += 1
        m.rows_put += len(my_rows)
        m.row_bytes_sent += result.bytes_sent
        m.row_bytes_received += result.bytes_received
        m.seconds_put += time.perf_counter() - start
        return [r + base for r in my_rows]

    def _on_device(self, columns: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """A put's columns checked (one dtype and number of dimensions per column)
        and on the dock's device."""
        for name, cells in columns.items():
            kinds = {(c.dtype, c.dim(), c.device) for c in cells}
            if len({dtype for dtype, _, _ in kinds}) > 1:
                raise TransferDockError(f"put column {name!r} mixes dtypes")
            dims = {ndim for _, ndim, _ in kinds}
            if len(dims) > 1:
                raise TransferDockError(f"put column {name!r} mixes cells of {sorted(dims)} "
                                        "dimensions; every cell of a column has the same "
                                        "number of dimensions")
            if any(device != self.device for _, _, device in kinds):  # stored where gets deliver
                columns[name] = [c.to(self.device) for c in cells]
        return columns

    def _local_rows(self, rows: Sequence[int], num_rows_local: int) -> list[int]:
        """A put of results' global row ids as the controller's local rows, checked."""
        base = self.controller.base
        rows = [int(r) - base for r in rows]
        if len(rows) != num_rows_local:
            raise TransferDockError(f"put got {len(rows)} row ids for {num_rows_local} rows")
        if rows and min(rows) < 0:
            raise TransferDockError(f"put of results for row {min(rows) + base}, which was "
                                    "retired (the dock no longer holds it)")
        return rows

    def _put_record(self, columns: Mapping[str, list[torch.Tensor]], rows: list[int] | None,
                    token_lengths: Sequence[int] | None, num_rows_per_group: int) -> PutRecord:
        """What this rank publishes about its part of a put."""
        shapes = {name: (str(cells[0].dtype), _shapes(cells, cells[0].dim()))
                  for name, cells in columns.items() if cells}
        if rows is not None:
            return PutRecord(rows=rows, columns=shapes, num_rows_per_group=num_rows_per_group)
        num_rows = _num_rows(columns)
        if token_lengths is None:
            integer = [cells for cells in columns.values()
                       if cells and not cells[0].is_floating_point()
                       and not cells[0].is_complex()]
            token_lengths = [sum(cells[i].numel() for cells in integer) for i in range(num_rows)]
        elif len(token_lengths) != num_rows:
            raise TransferDockError(f"put got {len(token_lengths)} token_lengths for "
                                    f"{num_rows} rows")
        return PutRecord(num_new_rows=num_rows, columns=shapes, token_lengths=token_lengths,
                         num_rows_per_group=num_rows_per_group)

    def get(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
            dp_group: dist.ProcessGroup | ConsumerLayout | None = None, *,
            whole_groups: bool = False, candidates: Sequence[int] | None = None
            ) -> DockBatch | None:
        """Deliver ``rows_per_dp_rank`` ready rows to every DP rank of ``consumer``.

        Collective over the dock: every rank calls it with the same consumer,
        columns and counts. Rows are the oldest whose ``columns`` are all ready
        and that ``consumer`` has not taken; they are balanced by token count
        across DP ranks, prefer the DP rank that already holds them, and are sent
        by their owners straight to every TP/PP peer of the receiving DP rank.

        Args:
            consumer: who takes the rows (each row reaches each consumer once).
            columns: the columns to deliver.
            rows_per_dp_rank: rows per DP rank (a multiple of the group size
                with ``whole_groups``).
            dp_group: this rank's DP process group (its DP peers; TP/PP peers share
                a DP index), or an explicit :class:`ConsumerLayout`, or ``None``:
                every dock rank is its own DP rank.
            whole_groups: keep the ``num_rows_per_group`` rows of a prompt together.
            candidates: global ids of the only rows to deliver (held ones too), in
                priority order; then ``rows_per_dp_rank`` is a bound, not a count (every
                rank passes the same list).

        Returns:
            this rank's :class:`DockBatch`, or ``None`` if the layout leaves it out.

        Raises:
            TransferDockError: on every rank alike if the request can never be
                met (names consumer, columns and counts).
            TransferDockTimeoutError: if a rank does not reach the call in time.
        """
        start = time.perf_counter()
        columns = list(columns)
        named = None if candidates is None else np.asarray(candidates, dtype=np.int64)
        ranks_per_dp = self._consumer_ranks(consumer, columns, rows_per_dp_rank, dp_group,
                                            whole_groups, named)
        ctl = self.controller
        if named is not None:
            named = named - ctl.base
            if len(named) and (named.min() < 0 or named.max() >= ctl.num_rows):
                raise TransferDockError(f"get for consumer {consumer!r} names rows outside the "
                                        f"dock's {ctl.base} to {ctl.next_row_id - 1}")
        rows_per_dp = ctl.plan_get(consumer, columns, rows_per_dp_rank, ranks_per_dp,
                                   whole_groups=whole_groups, candidates=named)
        my_dp = next((d for d, ranks in enumerate(ranks_per_dp) if self.rank in ranks), None)
        m = self.metrics
        if not any(len(rows) for rows in rows_per_dp):  # rows_per_dp_rank=0: nothing moves
            m.num_gets += 1
            m.seconds_get += time.perf_counter() - start
            return (DockBatch(rows=[], columns={c: [] for c in columns}, token_lengths=[])
                    if my_dp is not None else None)
        moves = get_moves(ctl, columns, ranks_per_dp, rows_per_dp, self.rank, self.size,
                          self._placement)
        result = self._exchange(moves, self.warehouse.read_many,
                                f"get for consumer {consumer!r}")
        self._keep(result.received)  # what arrived and stays here serves later consumers
        for ranks, rows in zip(ranks_per_dp, rows_per_dp):
            ctl.mark_taken(consumer, rows)
            ctl.mark_reached(columns, rows, ranks)
        m.num_gets += 1
        m.row_bytes_own += moves.own_bytes
        m.row_bytes_sent += result.bytes_sent
        m.row_bytes_received += result.bytes_received
        m.bytes_sent_per_consumer[consumer] = (m.bytes_sent_per_consumer.get(consumer, 0)
                                               + result.bytes_sent)
        batch = None
        if my_dp is not None:
            batch = self._batch(columns, rows_per_dp[my_dp], moves.local, result)
            m.rows_got += len(batch)
        m.seconds_get += time.perf_counter() - start
        return batch

    def _consumer_ranks(self, consumer: str, columns: list[str], rows_per_dp_rank: int,
                        dp_group: dist.ProcessGroup | ConsumerLayout | None,
                        whole_groups: bool, candidates: np.ndarray | None = None
                        ) -> list[list[int]]:
        """Run a get's control collective; return the dock ranks of each of the
        consumer's DP ranks."""
        if isinstance(dp_group, ConsumerLayout) or dp_group is None:
            my_dp_key = None
        else:
            my_dp_key = tuple(dist.get_process_group_ranks(dp_group))
        args = (consumer, tuple(columns), int(rows_per_dp_rank), bool(whole_groups),
                dp_group.ranks_per_dp_rank if isinstance(dp_group, ConsumerLayout) else None,
                my_dp_key is None,
                None if candidates is None else hash(tuple(candidates.tolist())))
        dp_keys, _ = self._control("get", f"get for consumer {consumer!r}", args,
                                   dp_key=my_dp_key or ())
        if isinstance(dp_group, ConsumerLayout):
            layout = dp_group
        elif dp_group is None:
            layout = ConsumerLayout(tuple((g,) for g in self._global_ranks))
        else:
            layout = ConsumerLayout.from_dp_groups(dict(zip(self._global_ranks, dp_keys)))
        try:
            return [[self._dock_rank_of_global[g] for g in ranks]
                    for ranks in layout.ranks_per_dp_rank]
        except KeyError as e:
            raise TransferDockError(f"get for consumer {consumer!r}: layout names rank {e}, "
                                    "which is not in the dock's group") from None

    def _batch(self, columns: Sequence[str], rows: np.ndarray, local: Mapping[str, np.ndarray],
               result: ExchangeResult) -> DockBatch:
        """This rank's batch: the cells it served itself and the ones it received, by row."""
        cells = {}
        for col in columns:
            parts = list(result.received.get(col, ()))
            if col in local:
                parts.append((local[col], self.warehouse.read_many(col, local[col])))
            cells[col] = in_row_order(parts) if parts else []
        ctl = self.controller
        return DockBatch(rows=(rows + ctl.base).tolist(), columns=cells,
                         token_lengths=ctl.token_length[rows].tolist())

    def retire(self, rows: Sequence[int] | None = None) -> None:
        """Drop ``rows`` (global ids; all rows when None): their cells leave every
        warehouse and no get delivers them again; the other rows stay for later gets.

        Row ids keep growing across retires. Local (no collective), but every rank
        must call it alike: the next put or get checks that all ranks have retired
        equally often.
        """
        ctl = self.controller
        local = None if rows is None else np.asarray(rows, dtype=np.int64) - ctl.base
        if local is not None and len(local) and (local.min() < 0 or local.max() >= ctl.num_rows):
            raise TransferDockError(f"retire of rows outside the dock's {ctl.base} to "
                                    f"{ctl.next_row_id - 1}")
        self._num_clears += 1
        if local is None:
            self._pending = []  # results for rows that no get will ever deliver
            self.warehouse.clear()
        else:
            self.warehouse.drop(local)
        shift = ctl.retire(local)
        if shift:
            self.warehouse.renumber(shift)
        if self._pending:  # unpublished results: drop retired rows, renumber the rest
            self._pending = [_without_rows(record, cells, local, shift)
                             for record, cells in self._pending]

    def release(self, rows: Sequence[int]) -> None:
        """Held ``rows`` (global ids) become visible to every consumer. Local, but every
        rank must call it alike (like :meth:`retire`)."""
        ctl = self.controller
        local = np.asarray(rows, dtype=np.int64) - ctl.base
        if len(local) and (local.min() < 0 or local.max() >= ctl.num_rows):
            raise TransferDockError(f"release of rows outside the dock's {ctl.base} to "
                                    f"{ctl.next_row_id - 1}")
        ctl.release(local)

    def rows(self, *, held: bool | None = None) -> np.ndarray:
        """Global ids of the live rows (only the held ones, or only the others), ascending;
        the same on every rank."""
        ctl = self.controller
        mask = ctl.live.copy()
        if held is not None:
            mask &= ctl.held if held else ~ctl.held
        return np.flatnonzero(mask) + ctl.base

    def tags(self, name: str, rows: Sequence[int]) -> np.ndarray:
        """The tag ``name`` of ``rows`` (global ids; -1 where unset)."""
        ctl = self.controller
        values = ctl.tags.get(name)
        local = np.asarray(rows, dtype=np.int64) - ctl.base
        return values[local] if values is not None else np.full(len(local), -1, np.int64)

    def clear(self) -> None:
        """Retire every row (the end of an iteration); row ids continue to grow."""
        self.retire(None)

    @property
    def num_rows(self) -> int:
        """Rows the dock holds now (same on every rank)."""
        return self.controller.num_live_rows

    @property
    def next_row_id(self) -> int:
        """The id the next new row gets (same on every rank)."""
        return self.controller.next_row_id

    def state_dict(self) -> dict:
        """This rank's dock: the replicated metadata and the cells it holds.

        Results put but not yet published are published first by a get; call this
        between iterations (after ``retire``), when every put has been applied.
        """
        if self._pending:
            raise TransferDockError("state_dict() with puts of results not yet published; "
                                    "save between iterations")
        return {"controller": self.controller.state_dict(), "cells": self.warehouse.state_dict(),
                "num_clears": self._num_clears, "num_calls": self._num_calls}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        self.warehouse.load_state_dict(state["cells"])
        self._num_clears, self._num_calls = int(state["num_clears"]), int(state["num_calls"])
        self._pending = []

    def reset_metrics(self) -> None:
        self.metrics = DockMetrics()
