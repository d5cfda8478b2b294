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

Typical GRPO use (every rank runs this)::

    dock = TransferDock(timeout_s=600)
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
import pickle
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from mindspeed_rl.errors import TransferDockError, TransferDockTimeoutError
from mindspeed_rl.transfer_dock.controller import ColumnPlacement, Controller, PutRecord
from mindspeed_rl.transfer_dock.exchange import ExchangeResult, exchange_blocks
from mindspeed_rl.transfer_dock.warehouse import Warehouse


_OPS = ("put", "get")  # op codes of the control header
_HEADER_FIELDS = 6  # op, call number, clears, argument hash, metadata bytes, dp_key length


def _flat(cells: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cells as 1-D tensors."""
    return [c if c.dim() == 1 else c.reshape(-1) for c in cells]


def _shapes(cells: Sequence[torch.Tensor], ndim: int) -> np.ndarray:
    """``[num_cells, ndim]`` int64 shapes of ``cells`` (all ``ndim``-D)."""
    if ndim == 1:
        return np.fromiter((c.numel() for c in cells), np.int64, len(cells))[:, None]
    return np.array([tuple(c.shape) for c in cells], dtype=np.int64).reshape(len(cells), ndim)


def _in_row_order(parts: Sequence[tuple[np.ndarray, Sequence[torch.Tensor]]]
                  ) -> list[torch.Tensor]:
    """Merge ``(rows ascending, cells)`` parts with disjoint rows into one list by row."""
    if len(parts) == 1:
        return list(parts[0][1])
    order = np.argsort(np.concatenate([rows for rows, _ in parts]), kind="stable")
    cells = [c for _, part in parts for c in part]
    return [cells[i] for i in order.tolist()]


def _without_rows(record: PutRecord, cells: list[tuple[str, list[torch.Tensor]]],
                  retired: np.ndarray, shift: int
                  ) -> tuple[PutRecord, list[tuple[str, list[torch.Tensor]]]]:
    """A put of results not yet published, minus the ``retired`` rows, renumbered by
    ``shift`` (the record stays, possibly empty: ranks pair puts by their order)."""
    keep = ~np.isin(record.rows, retired)
    index = np.flatnonzero(keep).tolist()
    columns = {name: (dtype, shapes[keep]) for name, (dtype, shapes) in record.columns.items()}
    return (PutRecord(rows=record.rows[keep] - shift, columns=columns),
            [(name, [c[i] for i in index]) for name, c in cells])


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
                 pipeline_model_parallel_size: int = 1) -> "ConsumerLayout":
        """Megatron's default rank order (TP fastest, then DP, then PP)."""
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ValueError(f"world_size={world_size} is not divisible by TP={tp} x PP={pp}")
        dp = world_size // (tp * pp)
        return cls(tuple(
            tuple(p * tp * dp + d * tp + t for p in range(pp) for t in range(tp))
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


@dataclass
class DockBatch:
    """The rows one DP rank received from a get.

    ``columns[name][i]`` is the tensor of row ``rows[i]`` (variable length, e.g.
    ``[num_tokens]``, or ``[]`` for a per-row scalar). Rows are in ascending id
    order, so whole groups are contiguous. Cells this rank already held are the
    warehouse's own tensors: do not modify them in place.
    """

    rows: list[int]
    columns: dict[str, list[torch.Tensor]]
    token_lengths: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str) -> list[torch.Tensor]:
        return self.columns[column]

    def padded(self, column: str, pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``[num_rows, max_len]`` tensor of a 1-D column, and ``[num_rows]``
        lengths."""
        cells = self.columns[column]
        lengths = torch.tensor([c.numel() for c in cells], dtype=torch.int64)
        if not cells:
            return torch.empty(0, 0), lengths
        return (torch.nn.utils.rnn.pad_sequence(_flat(cells), batch_first=True,
                                                padding_value=pad_value), lengths)


@dataclass
class DockMetrics:
    """Counters of this rank since the last :meth:`TransferDock.reset_metrics`.

    ``row_bytes_*`` count payload that crossed ranks (hand-overs within a rank
    are free and not counted); seconds are wall time inside dock calls.
    """

    num_puts: int = 0
    num_gets: int = 0
    rows_put: int = 0  # cells' rows written by this rank (new or existing)
    rows_got: int = 0  # rows delivered to this rank
    row_bytes_sent: int = 0
    row_bytes_received: int = 0
    # Bytes of cells this rank computed that another rank consumed, plus cells it
    # consumed that another rank computed: what any placement must move through
    # this rank (its own share). Same in both modes.
    row_bytes_own: int = 0
    seconds_put: float = 0.0
    seconds_get: float = 0.0
    num_collectives: int = 0  # control and data collectives of this rank
    bytes_sent_per_consumer: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__, bytes_sent_per_consumer=dict(self.bytes_sent_per_consumer))


class TransferDock:
    """Distributed replay buffer: replicated metadata, per-rank warehouses, P2P data.

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
    """

    mode = "distributed"

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
        timeout = timedelta(seconds=self.timeout_s)
        # Own groups, so the dock's timeout bounds its waits whatever the caller's
        # groups use; new_group is collective over the world.
        self._meta_group = dist.new_group(self._global_ranks, timeout=timeout, backend="gloo")
        backend = data_backend or dist.get_backend(group)
        if str(backend).lower() == "gloo":
            self._data_group = self._meta_group
            self.device = torch.device(device or "cpu")
        else:
            self._data_group = dist.new_group(self._global_ranks, timeout=timeout, backend=backend)
            if device is None:
                acc = torch.accelerator.current_accelerator()
                device = torch.device(acc.type, torch.accelerator.current_device_index())
            self.device = torch.device(device)
        self.controller = Controller()
        self.warehouse = Warehouse()
        self._num_calls = 0
        self._num_clears = 0
        # Puts of results not yet published: (record, [(column, cells of record.rows)]).
        self._pending: list[tuple[PutRecord, list[tuple[str, list[torch.Tensor]]]]] = []
        self.metrics = DockMetrics()

    # ---- placement (the only thing the centralized mode changes) ---------------
    # Distributed: every rank keeps the cells it computed and the cells gets
    # delivered to it; a rank lacking a cell receives it from the cell's owner.
    keeps_copies = True

    def _senders(self, owners: np.ndarray) -> np.ndarray:
        """Rank that sends each cell to a rank lacking it: its owner (who computed it)."""
        return owners

    def _held_by(self, rank: int, reached: np.ndarray) -> np.ndarray:
        """Which cells (by their ``reached`` rank-set ids) ``rank`` already holds."""
        return self.controller.rank_sets.contains(reached, rank)

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
        gloo in which each rank sends every peer the same block: an int64 header
        ``[op, call number, clears so far, hash of the arguments, metadata bytes,
        dp_key length, dp_key...]`` followed by up to ``eager_bytes`` of pickled
        metadata. Blocks have the same size whatever a rank called, so ranks that
        disagree on the call are caught here, by the headers, and never reach a
        transfer whose sizes do not match (which gloo answers by aborting the
        process). Metadata larger than ``eager_bytes`` follows in a second
        all-to-all sized from the headers. An all-to-all rather than an
        all-gather: gloo sends it in one round of direct messages instead of a
        ring of size - 1 steps (1.3 vs 3.8 ms at 4 ranks on 2 cores).
        The records of puts of results made since the last control collective
        (``self._pending``, see :meth:`put`) ride along and are applied first,
        in call order, on every rank. Returns every rank's ``dp_key`` and payload.
        """
        self._num_calls += 1
        blob = pickle.dumps(([record for record, _ in self._pending], payload),
                            protocol=pickle.HIGHEST_PROTOCOL)
        header_bytes = 8 * (_HEADER_FIELDS + self.size)
        block = torch.zeros(header_bytes + self.eager_bytes, dtype=torch.uint8)
        header = block[:header_bytes].view(torch.int64)
        header[:_HEADER_FIELDS] = torch.tensor([
            _OPS.index(op), self._num_calls, self._num_clears,
            zlib.crc32(repr(args).encode()), len(blob), len(dp_key)])
        header[_HEADER_FIELDS:_HEADER_FIELDS + len(dp_key)] = torch.tensor(list(dp_key),
                                                                           dtype=torch.int64)
        if 0 < len(blob) <= self.eager_bytes:
            block[header_bytes:header_bytes + len(blob)] = torch.frombuffer(
                bytearray(blob), dtype=torch.uint8)
        recv = torch.empty(self.size * block.numel(), dtype=torch.uint8)
        self._all_to_all(recv, block.repeat(self.size), what)
        blocks = recv.view(self.size, -1)
        headers = blocks[:, :header_bytes].contiguous().view(torch.int64).tolist()

        calls = [tuple(h[:4]) for h in headers]
        if len(set(calls)) != 1:
            described = "; ".join(
                f"rank {self._global_ranks[r]}: {_OPS[o] if 0 <= o < len(_OPS) else o} "
                f"(dock call #{n}, after {c} clear())" for r, (o, n, c, _) in enumerate(calls))
            same_op = len({c[:3] for c in calls}) == 1
            raise TransferDockError(
                f"{what}: ranks disagree on the dock call ({described}"
                f"{'; same call, different arguments' if same_op else ''}); every rank must "
                "call put/get/clear alike and in the same order (a put that creates rows, "
                "rows=None, is one call on every rank; so is a put of results: a rank with no "
                "results passes rows=[])")
        dp_keys = [tuple(h[_HEADER_FIELDS:_HEADER_FIELDS + h[5]]) for h in headers]
        sizes = [h[4] for h in headers]
        blobs: list[bytes | None] = [None] * self.size
        for r, n in enumerate(sizes):
            if n <= self.eager_bytes:
                blobs[r] = blocks[r, header_bytes:header_bytes + n].numpy().tobytes()
        overflow = [n if n > self.eager_bytes else 0 for n in sizes]
        if any(overflow):  # every rank sees the same sizes, so all take this branch
            mine = overflow[self.rank]
            send = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).repeat(self.size)
                    if mine else torch.empty(0, dtype=torch.uint8))
            big = torch.empty(sum(overflow), dtype=torch.uint8)
            self._all_to_all(big, send, what, recv_splits=overflow,
                             send_splits=[mine] * self.size)
            for r, piece in enumerate(big.split(overflow)):
                if overflow[r]:
                    blobs[r] = piece.numpy().tobytes()
        pending_per_rank, payloads = zip(*(pickle.loads(b) for b in blobs))
        mine, self._pending = self._pending, []
        for k, records in enumerate(zip(*pending_per_rank)):
            try:
                self.controller.apply_put(records)
            except TransferDockError as e:  # this put and later ones are dropped
                raise TransferDockError(
                    f"a put of results published with this {what} (put {k + 1} of "
                    f"{len(mine)} since the last get): {e}") from None
            rows = mine[k][0].rows.tolist()
            for name, cells in mine[k][1]:
                self.warehouse.write_many(name, rows, cells)
        return dp_keys, list(payloads)

    # ---- data movement ------------------------------------------------------------
    def _no_blocks(self) -> list[dict[str, np.ndarray]]:
        return [{} for _ in range(self.size)]

    def _exchange(self, any_remote: bool, outgoing, incoming, read_cells, what: str
                  ) -> ExchangeResult:
        if not any_remote:  # every rank reaches the same verdict from the metadata
            return ExchangeResult({}, 0, 0)
        self.metrics.num_collectives += 1
        return exchange_blocks(
            outgoing, incoming, read_cells=read_cells, columns=self.controller.columns,
            group=self._data_group, device=self.device,
            timeout_context=lambda: self._bounded(what))

    def _keep(self, received: Mapping[str, Sequence[tuple[np.ndarray, Sequence[torch.Tensor]]]]
              ) -> None:
        for name, parts in received.items():
            for rows, cells in parts:
                self.warehouse.write_many(name, rows.tolist(), cells)

    # ---- public API ---------------------------------------------------------------
    def put(self, columns: Mapping[str, Sequence[torch.Tensor]], rows: Sequence[int] | None = None,
            *, token_lengths: Sequence[int] | None = None,
            num_rows_per_group: int = 1) -> list[int]:
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

        Returns:
            the global row ids written by this rank, in put order.

        TP/PP peers that computed the same cells may all put them: one of them
        keeps each cell (rotating by row), so nothing is stored twice.
        """
        start = time.perf_counter()
        columns = {name: list(cells) for name, cells in columns.items()}
        num_rows = {len(cells) for cells in columns.values()}
        if len(num_rows) > 1:
            raise TransferDockError(f"put columns have different row counts "
                                    f"{ {n: len(c) for n, c in columns.items()} }")
        num_rows_local = num_rows.pop() if num_rows else 0
        base = self.controller.base
        if rows is not None:
            rows = [int(r) - base for r in rows]  # global ids -> the controller's local rows
            if len(rows) != num_rows_local:
                raise TransferDockError(f"put got {len(rows)} row ids for {num_rows_local} rows")
            if rows and min(rows) < 0:
                raise TransferDockError(f"put of results for row {min(rows) + base}, which was "
                                        "retired (the dock no longer holds it)")
        shapes = {}
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
                columns[name] = cells = [c.to(self.device) for c in cells]
            if cells:
                shapes[name] = (str(cells[0].dtype), _shapes(cells, dims.pop()))
        if rows is None:
            if token_lengths is None:
                integer = [cells for cells in columns.values()
                           if cells and not cells[0].is_floating_point()
                           and not cells[0].is_complex()]
                token_lengths = [sum(cells[i].numel() for cells in integer)
                                 for i in range(num_rows_local)]
            elif len(token_lengths) != num_rows_local:
                raise TransferDockError(f"put got {len(token_lengths)} token_lengths for "
                                        f"{num_rows_local} rows")
        record = PutRecord(
            num_new_rows=num_rows_local if rows is None else 0,
            rows=rows if rows is not None else (),
            columns=shapes,
            token_lengths=token_lengths if rows is None else (),
            num_rows_per_group=num_rows_per_group,
        )

        if rows is not None and self.keeps_copies:
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
            if self.keeps_copies:  # every rank that computed a cell keeps it: nothing moves
                for name, cells in columns.items():
                    self.warehouse.write_many(name, my_rows, cells)
                result = ExchangeResult({}, 0, 0)
            else:
                result = self._hand_to_homes(columns, my_rows, placements)

        m = self.metrics
        m.num_puts += 1
        m.rows_put += len(my_rows)
        m.row_bytes_sent += result.bytes_sent
        m.row_bytes_received += result.bytes_received
        m.seconds_put += time.perf_counter() - start
        return [r + base for r in my_rows]

    def _hand_to_homes(self, columns: Mapping[str, list[torch.Tensor]], my_rows: list[int],
                       placements: Sequence[ColumnPlacement]) -> ExchangeResult:
        """Centralized put: the owner of each cell hands it to the rank that stores it."""
        position = {row: i for i, row in enumerate(my_rows)}

        def local_cells(column: str, cell_rows: np.ndarray) -> list[torch.Tensor]:
            cells = columns[column]
            return [cells[position[r]] for r in cell_rows.tolist()]

        outgoing, incoming = self._no_blocks(), self._no_blocks()
        any_remote = False
        for column, cell_rows, owners in placements:  # (column, row): the wire order
            homes = self._senders(owners)
            remote = homes != owners
            mine = owners == self.rank
            kept = cell_rows[mine & ~remote]
            if len(kept):
                self.warehouse.write_many(column, kept.tolist(), local_cells(column, kept))
            if remote.any():
                any_remote = True
                for peer in range(self.size):
                    send = cell_rows[mine & remote & (homes == peer)]
                    if len(send):
                        outgoing[peer][column] = send
                    receive = cell_rows[(homes == self.rank) & remote & (owners == peer)]
                    if len(receive):
                        incoming[peer][column] = receive
        result = self._exchange(any_remote, outgoing, incoming, local_cells,
                                "put (moving cells to their home rank)")
        self._keep(result.received)
        return result

    def get(self, consumer: str, columns: Sequence[str], rows_per_dp_rank: int,
            dp_group: dist.ProcessGroup | ConsumerLayout | None = None, *,
            whole_groups: bool = False) -> DockBatch | None:
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

        Returns:
            this rank's :class:`DockBatch`, or ``None`` if the layout leaves it out.

        Raises:
            TransferDockError: on every rank alike if the request can never be
                met (names consumer, columns and counts).
            TransferDockTimeoutError: if a rank does not reach the call in time.
        """
        start = time.perf_counter()
        columns = list(columns)
        if isinstance(dp_group, ConsumerLayout) or dp_group is None:
            my_dp_key = None
        else:
            my_dp_key = tuple(dist.get_process_group_ranks(dp_group))
        args = (consumer, tuple(columns), int(rows_per_dp_rank), bool(whole_groups),
                dp_group.ranks_per_dp_rank if isinstance(dp_group, ConsumerLayout) else None,
                my_dp_key is None)
        dp_keys, _ = self._control("get", f"get for consumer {consumer!r}", args,
                                   dp_key=my_dp_key or ())
        if isinstance(dp_group, ConsumerLayout):
            layout = dp_group
        elif dp_group is None:
            layout = ConsumerLayout(tuple((g,) for g in self._global_ranks))
        else:
            layout = ConsumerLayout.from_dp_groups(dict(zip(self._global_ranks, dp_keys)))
        try:
            ranks_per_dp = [[self._dock_rank_of_global[g] for g in ranks]
                            for ranks in layout.ranks_per_dp_rank]
        except KeyError as e:
            raise TransferDockError(f"get for consumer {consumer!r}: layout names rank {e}, "
                                    "which is not in the dock's group") from None

        ctl = self.controller
        rows_per_dp = ctl.plan_get(consumer, columns, rows_per_dp_rank, ranks_per_dp,
                                   whole_groups=whole_groups)
        my_dp = next((d for d, ranks in enumerate(ranks_per_dp) if self.rank in ranks), None)
        if not any(len(rows) for rows in rows_per_dp):  # rows_per_dp_rank=0: nothing moves
            self.metrics.num_gets += 1
            self.metrics.seconds_get += time.perf_counter() - start
            return (DockBatch(rows=[], columns={c: [] for c in columns}, token_lengths=[])
                    if my_dp is not None else None)
        outgoing, incoming, local, any_remote, own_bytes = self._plan_moves(
            columns, ranks_per_dp, rows_per_dp)
        result = self._exchange(any_remote, outgoing, incoming, self.warehouse.read_many,
                                f"get for consumer {consumer!r}")
        if self.keeps_copies:  # what arrived stays here for later consumers
            self._keep(result.received)
        for ranks, rows in zip(ranks_per_dp, rows_per_dp):
            ctl.mark_taken(consumer, rows)
            ctl.mark_reached(columns, rows, ranks)

        m = self.metrics
        m.num_gets += 1
        m.row_bytes_own += own_bytes
        m.row_bytes_sent += result.bytes_sent
        m.row_bytes_received += result.bytes_received
        m.bytes_sent_per_consumer[consumer] = (m.bytes_sent_per_consumer.get(consumer, 0)
                                               + result.bytes_sent)
        batch = None
        if my_dp is not None:
            rows = rows_per_dp[my_dp]
            cells = {}
            for col in columns:
                parts = list(result.received.get(col, ()))
                if col in local:
                    parts.append((local[col], self.warehouse.read_many(col, local[col])))
                cells[col] = _in_row_order(parts) if parts else []
            batch = DockBatch(rows=(rows + ctl.base).tolist(), columns=cells,
                              token_lengths=ctl.token_length[rows].tolist())
            m.rows_got += len(rows)
        m.seconds_get += time.perf_counter() - start
        return batch

    def _plan_moves(self, columns: Sequence[str], ranks_per_dp: Sequence[Sequence[int]],
                    rows_per_dp: Sequence[np.ndarray]):
        """This rank's part of a get's data movement, from the replicated metadata.

        Returns ``(outgoing, incoming, local, any_remote, own_bytes)``: the blocks
        this rank sends to / receives from each peer (``{column: rows}``; the
        order (column, rows ascending) is the wire order both ends agree on), the
        rows per column it delivers from its own warehouse, whether any cell
        crosses ranks anywhere, and this rank's own share of the bytes.
        Vectorised over columns: every rank runs this on every get.
        """
        ctl = self.controller
        outgoing, incoming = self._no_blocks(), self._no_blocks()
        local: dict[str, np.ndarray] = {}
        any_remote = False
        own_bytes = 0
        metas = [ctl.columns[c] for c in columns]
        for ranks, rows in zip(ranks_per_dp, rows_per_dp):
            if not len(rows):
                continue
            owners = np.stack([meta.owner[rows] for meta in metas])  # [columns, rows]
            reached = np.stack([meta.reached[rows] for meta in metas])
            senders = self._senders(owners)
            for dst in ranks:
                # This rank's share of what any placement must move: cells it
                # consumes for the first time, or computed and dst consumes first.
                first_time = ~ctl.rank_sets.contains(reached, dst)
                if dst != self.rank:
                    first_time &= owners == self.rank
                for i in np.flatnonzero(first_time.any(axis=1)).tolist():
                    own_bytes += int(metas[i].nbytes(rows[first_time[i]]).sum())
                missing = ~self._held_by(dst, reached)
                any_remote = any_remote or bool(missing.any())
                if dst == self.rank:
                    for i, col in enumerate(columns):
                        if not missing[i].any():
                            local[col] = rows
                            continue
                        if not missing[i].all():
                            local[col] = rows[~missing[i]]
                        for peer in np.unique(senders[i][missing[i]]).tolist():
                            incoming[peer][col] = rows[missing[i] & (senders[i] == peer)]
                else:
                    send = missing & (senders == self.rank)
                    for i in np.flatnonzero(send.any(axis=1)).tolist():
                        outgoing[dst][columns[i]] = rows[send[i]]
        return outgoing, incoming, local, any_remote, own_bytes

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

    def num_ready(self, consumer: str, columns: Sequence[str]) -> int:
        """Rows whose ``columns`` are all ready and that ``consumer`` has not taken (local, no
        communication; same on every rank). Counts what is published: puts of results
        since the last get are published by the next one."""
        return int(self.controller.ready_mask(consumer, list(columns)).sum())

    def reset_metrics(self) -> None:
        self.metrics = DockMetrics()
