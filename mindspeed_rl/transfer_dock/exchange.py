"""Moving cells between ranks: one ``all_to_all_single`` of packed bytes.

Every rank derives the same plan from replicated metadata, so each rank knows,
without asking, which cells (and so how many bytes) it sends to and receives
from every peer: no size exchange precedes the data. The bytes for one peer are
laid out as blocks, one per column, each block the column's cells of the rows
concerned, back to back in ascending row order (``[sum(numel)]`` of the column's
dtype), starting at a 16-byte boundary. A block is packed with one ``torch.cat``
and unpacked with one ``torch.split``, so the per-cell cost stays in C++.

The buffers live on the transfer device: the accelerator for NCCL/HCCL groups,
the host for gloo (which implements ``all_to_all_single`` with uneven splits in
torch >= 2.x).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

_ALIGN_BYTES = 16  # covers every torch dtype's alignment (complex128 is 16)

# Per peer: column -> rows (ascending int64 array); both sides must build these in
# the same order (columns in the same order, rows ascending) — the order is the layout.
BlocksPerPeer = Sequence[dict[str, np.ndarray]]


@dataclass
class ExchangeResult:
    """Cells received by this rank (1-D views), and the payload bytes that crossed ranks."""

    cells: dict[tuple[int, str], torch.Tensor]
    bytes_sent: int
    bytes_received: int


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN_BYTES) * _ALIGN_BYTES


def exchange_blocks(outgoing: BlocksPerPeer, incoming: BlocksPerPeer, *,
                    read_cells: Callable[[str, np.ndarray], list[torch.Tensor]],
                    numel: Callable[[str, np.ndarray], np.ndarray],
                    dtype: Callable[[str], torch.dtype],
                    group: dist.ProcessGroup | None, device: torch.device,
                    timeout_context: Callable[[], contextlib.AbstractContextManager]
                    ) -> ExchangeResult:
    """Send ``outgoing[peer]`` blocks to each peer and receive ``incoming[peer]`` blocks.

    Must be called by every rank of ``group`` with mutually consistent plans:
    what rank ``a`` lists in ``outgoing[b]`` is exactly what ``b`` lists in
    ``incoming[a]``. ``read_cells(column, rows)`` returns the 1-D cells this rank
    holds, ``numel(column, rows)`` their element counts, ``dtype`` a column's
    dtype. ``timeout_context()`` wraps the collective. When no cell crosses ranks
    anywhere (every rank can tell from the metadata) callers skip the call on
    every rank alike.
    """
    group_size = len(outgoing)
    send_splits = [0] * group_size
    recv_splits = [0] * group_size
    bytes_sent = bytes_received = 0
    recv_numels: list[dict[str, list[int]]] = [{} for _ in range(group_size)]
    for peer in range(group_size):
        for column, rows in outgoing[peer].items():
            n = int(numel(column, rows).sum()) * dtype(column).itemsize
            send_splits[peer] += _padded(n)
            bytes_sent += n
        for column, rows in incoming[peer].items():
            numels = recv_numels[peer][column] = numel(column, rows).tolist()
            n = sum(numels) * dtype(column).itemsize
            recv_splits[peer] += _padded(n)
            bytes_received += n

    send = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
    offset = 0
    for peer in range(group_size):
        for column, rows in outgoing[peer].items():
            dt = dtype(column)
            cells = [c.to(device) for c in read_cells(column, rows)]
            n = sum(c.numel() for c in cells)
            torch.cat(cells, out=send[offset:offset + n * dt.itemsize].view(dt))
            offset += _padded(n * dt.itemsize)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    with timeout_context():
        dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)

    cells_received: dict[tuple[int, str], torch.Tensor] = {}
    offset = 0
    for peer in range(group_size):
        for column, rows in incoming[peer].items():
            dt = dtype(column)
            numels = recv_numels[peer][column]
            n = sum(numels)
            # Views into the receive buffer: no copy per cell.
            pieces = recv[offset:offset + n * dt.itemsize].view(dt).split(numels)
            cells_received.update(zip(((r, column) for r in rows.tolist()), pieces))
            offset += _padded(n * dt.itemsize)
    return ExchangeResult(cells_received, bytes_sent, bytes_received)
