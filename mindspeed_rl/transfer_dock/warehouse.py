"""The cells this rank physically holds: a column store of variable-length rows.

Each cell is one tensor (``[num_tokens]`` for token ids or log-probs, ``[]`` for a
per-row scalar), stored exactly as put: no padding at rest. Which rank holds a
cell is decided by the controller; the warehouse only stores and hands out.
"""

from __future__ import annotations

import numpy as np
import torch


class Warehouse:
    """This rank's cells: ``column -> row -> tensor``."""

    def __init__(self) -> None:
        self._cells: dict[str, dict[int, torch.Tensor]] = {}

    def write_many(self, column: str, rows, tensors) -> None:
        """Store the cells of ``rows`` (ints) of one column (the tensors themselves)."""
        self._cells.setdefault(column, {}).update(zip(rows, tensors))

    def read_many(self, column: str, rows: np.ndarray) -> list[torch.Tensor]:
        """The stored tensors of ``rows`` (an int array) of one column."""
        cells = self._cells.get(column, {})
        try:
            return [cells[r] for r in rows.tolist()]
        except KeyError as e:
            raise KeyError(f"this rank's warehouse does not hold column {column!r} of row "
                           f"{e.args[0]}") from None

    @property
    def num_bytes(self) -> int:
        """Bytes held at rest (payload only)."""
        return sum(t.numel() * t.element_size() for rows in self._cells.values()
                   for t in rows.values())

    def clear(self) -> None:
        """Drop every cell."""
        self._cells.clear()

    def drop(self, rows: np.ndarray) -> None:
        """Drop every cell of ``rows`` (an int array)."""
        for cells in self._cells.values():
            for r in rows.tolist():
                cells.pop(r, None)

    def renumber(self, shift: int) -> None:
        """Row ``r`` becomes ``r - shift`` (the controller dropped ``shift`` leading rows)."""
        self._cells = {c: {r - shift: t for r, t in cells.items()}
                       for c, cells in self._cells.items()}

    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        """The cells, each in storage of its own: a cell may be a view into a buffer it
        shares with cells of other dtypes (a transfer's receive buffer), which torch.save
        refuses and which would otherwise be written whole."""
        return {c: {r: _own_storage(t) for r, t in cells.items()}
                for c, cells in self._cells.items() if cells}

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        self._cells = {c: dict(cells) for c, cells in state.items()}


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a compact copy when it views part of a larger storage."""
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()
