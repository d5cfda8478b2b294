"""What a get hands a DP rank (:class:`DockBatch`) and what a rank counts (:class:`DockMetrics`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


def _flat(cells: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cells as 1-D tensors."""
    return [c if c.dim() == 1 else c.reshape(-1) for c in cells]


def in_row_order(parts: Sequence[tuple[np.ndarray, Sequence[torch.Tensor]]]
                  ) -> list[torch.Tensor]:
    """Merge ``(rows ascending, cells)`` parts with disjoint rows into one list by row."""
    if len(parts) == 1:
        return list(parts[0][1])
    order = np.argsort(np.concatenate([rows for rows, _ in parts]), kind="stable")
    cells = [c for _, part in parts for c in part]
    return [cells[i] for i in order.tolist()]


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
