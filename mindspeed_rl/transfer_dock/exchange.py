"""Moving cells between ranks: one ``all_to_all_single`` of packed bytes.

Every rank derives the same plan from replicated metadata, so each rank knows,
without asking, which cells (and so how many bytes) it sends to and receives
from every peer: no size exchange precedes the data. The bytes for one peer are
laid out as blocks, one per column, each block the column's cells of the rows
concerned, back to back in ascending row order (``[sum(numel)]`` of the column's
dtype), starting at a 16-byte boundary. A block is packed with one ``torch.cat``
(``torch.stack`` for scalar cells) and unpacked with one ``split_with_sizes``
(``unbind`` for scalars), so the per-cell cost stays in C++: on a busy host the
dock's per-cell Python is what every rank pays on every get.

The buffers live on the transfer device: the accelerator for NCCL/HCCL groups,
the host for gloo (which implements ``all_to_all_single`` with uneven splits in
torch >= 2.x). Cells must already be on that device (the dock moves them there
when they are put).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

_ALIGN_BYTES = 16  # covers every torch dtype's alignment (complex128 is 16)

# Per peer: column -> rows (ascending int64 array); both sides must build these in
# the same order (columns in the same order, rows ascending) — the order is the layout.
BlocksPerPeer = Sequence[dict[str, np.ndarray]]


class ColumnMeta(Protocol):
    """What the exchange needs to know about a column (the controller's ``_Column``)."""

    dtype: torch.dtype
    ndim: int
    numel: np.ndarray  # [num_rows] elements per cell
    shape: np.ndarray  # [num_rows, ndim]


@dataclass
class ExchangeResult:
    """What this rank received, and the payload bytes that crossed ranks.

    ``received[column]`` is one ``(rows, cells)`` pair per sending peer: rows
    ascending, cells views into the receive buffer in their stored shapes.
    """

    received: dict[str, list[tuple[np.ndarray, Sequence[torch.Tensor]]]]
    bytes_sent: int
    bytes_received: int


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN_BYTES) * _ALIGN_BYTES


def pack_cells(cells: Sequence[torch.Tensor], ndim: int, out: torch.Tensor) -> None:
    """Write ``cells`` (all ``ndim``-D) back to back into the 1-D ``out``."""
    if ndim == 0:
        torch.stack(list(cells), out=out)
    elif ndim == 1:
        torch.cat(list(cells), out=out)
    else:
        torch.cat([c.reshape(-1) for c in cells], out=out)


def unpack_cells(flat: torch.Tensor, ndim: int, numels: list[int],
                 shapes: np.ndarray) -> Sequence[torch.Tensor]:
    """Views of ``flat`` as the cells :func:`pack_cells` wrote (``shapes`` only for ndim >= 2)."""
    if ndim == 0:
        return flat.unbind(0)
    pieces = flat.split_with_sizes(numels)
    if ndim == 1:
        return pieces
    return [p.view(s) for p, s in zip(pieces, shapes.tolist())]


def exchange_blocks(outgoing: BlocksPerPeer, incoming: BlocksPerPeer, *,
                    read_cells: Callable[[str, np.ndarray], Sequence[torch.Tensor]],
                    columns: Mapping[str, ColumnMeta],
                    group: dist.ProcessGroup | None, device: torch.device,
                    timeout_context: Callable[[], contextlib.AbstractContextManager]
                    ) -> ExchangeResult:
    """Send ``outgoing[peer]`` blocks to each peer and receive ``incoming[peer]`` blocks.

    Must be called by every rank of ``group`` with mutually consistent plans:
    what rank ``a`` lists in ``outgoing[b]`` is exactly what ``b`` lists in
    ``incoming[a]``. ``read_cells(column, rows)`` returns the cells this rank
    holds, ``columns[name]`` describes a column. ``timeout_context()`` wraps the
    collective. When no cell crosses ranks anywhere (every rank can tell from
    the metadata) callers skip the call on every rank alike.
    """
    group_size = len(outgoing)
    send_splits = [0] * group_size
    recv_splits = [0] * group_size
    bytes_sent = bytes_received = 0
    send_numel: list[dict[str, int]] = [{} for _ in range(group_size)]
    recv_numels: list[dict[str, np.ndarray]] = [{} for _ in range(group_size)]
    for peer in range(group_size):
        for name, rows in outgoing[peer].items():
            col = columns[name]
            n = send_numel[peer][name] = int(col.numel[rows].sum())
            send_splits[peer] += _padded(n * col.dtype.itemsize)
            bytes_sent += n * col.dtype.itemsize
        for name, rows in incoming[peer].items():
            col = columns[name]
            numels = recv_numels[peer][name] = col.numel[rows]
            n = int(numels.sum()) * col.dtype.itemsize
            recv_splits[peer] += _padded(n)
            bytes_received += n

    send = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
    offset = 0
    for peer in range(group_size):
        for name, rows in outgoing[peer].items():
            col = columns[name]
            n = send_numel[peer][name] * col.dtype.itemsize
            pack_cells(read_cells(name, rows), col.ndim, send[offset:offset + n].view(col.dtype))
            offset += _padded(n)
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    with timeout_context():
        dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)

    received: dict[str, list[tuple[np.ndarray, Sequence[torch.Tensor]]]] = {}
    offset = 0
    for peer in range(group_size):
        for name, rows in incoming[peer].items():
            col = columns[name]
            numels = recv_numels[peer][name]
            n = int(numels.sum()) * col.dtype.itemsize
            # Views into the receive buffer: no copy per cell.
            cells = unpack_cells(recv[offset:offset + n].view(col.dtype), col.ndim,
                                 numels.tolist(), col.shape[rows] if col.ndim > 1 else None)
            received.setdefault(name, []).append((rows, cells))
            offset += _padded(n)
    return ExchangeResult(received, bytes_sent, bytes_received)
