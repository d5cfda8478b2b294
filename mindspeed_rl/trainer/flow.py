"""The TransferDock seen through the column contract, for one algorithm.

Phases never call the dock directly: ``SampleFlow`` checks that a phase puts
only the columns the contract says it produces (with the declared dtype and
shape) and gets only the columns it consumes, keeps only the columns some phase
of the running algorithm reads, and hides the SPMD protocol (a rank that
received no rows still takes part in a put of results).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.trainer.columns import COLUMNS, Column, ContractError, active_columns
from mindspeed_rl.transfer_dock import ConsumerLayout, DockBatch, TransferDock


def row_batch(batch: DockBatch | None, extras: Sequence[str] = ()) -> RowBatch:
    """A dock batch as the engine's rows (prompt, response, the ``extras`` columns); an
    empty one for a rank that received none."""
    if batch is None:
        return RowBatch([], [], {})
    return RowBatch(batch["prompt_ids"], batch["response_ids"], {k: batch[k] for k in extras})


def pad_cells(cells: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """([rows, R] mask, [rows, R] float32 values) of variable-length per-token cells, R the
    longest; the mask is 1 on each cell's own positions."""
    padded = torch.nn.utils.rnn.pad_sequence(list(cells), batch_first=True) if cells else \
        torch.zeros(0, 0)
    mask = torch.zeros_like(padded)
    for i, c in enumerate(cells):
        mask[i, :len(c)] = 1.0
    return mask, padded.float()


class SampleFlow:
    """Puts and gets of the phases of one algorithm, checked against the contract.

    Args:
        dock: the TransferDock of the run.
        phases: the algorithm's phase names, in order.
        layouts: named consumer layouts (e.g. ``train``: the megatron DP ranks with
            their TP/PP peers; ``gen_writers``: one rank per generation-DP rank).
        features: optional features of the run whose columns are stored
            (``partial_rollout``: its rollout also reads back the rows it wrote).
    """

    def __init__(self, dock: TransferDock, phases: Sequence[str],
                 layouts: Mapping[str, ConsumerLayout],
                 columns: Mapping[str, Column] = COLUMNS, *, trace: bool = False,
                 features: Sequence[str] = ()) -> None:
        self.dock = dock
        self.phases = tuple(phases)
        self.layouts = dict(layouts)
        self.columns = dict(columns)
        self.active = active_columns(self.phases, self.columns, features)
        # With ``trace``: {consumer: row ids this rank received} since the last retire_all.
        self.trace: dict[str, list[int]] | None = {} if trace else None

    def _column(self, phase: str, name: str, role: str) -> Column:
        col = self.columns.get(name)
        if col is None:
            raise ContractError(f"phase {phase!r} {role}s column {name!r}, which the column "
                                "contract (mindspeed_rl/trainer/columns.py) does not declare")
        allowed = col.producers if role == "put" else col.consumers
        if phase not in allowed:
            raise ContractError(f"phase {phase!r} {role}s column {name!r}, but the contract "
                                f"lets only {list(allowed)} {role} it")
        return col

    def _checked(self, phase: str, columns: Mapping[str, Sequence[torch.Tensor]]
                 ) -> dict[str, list[torch.Tensor]]:
        kept = {}
        for name, cells in columns.items():
            col = self._column(phase, name, "put")
            for cell in cells:
                if not col.accepts(cell.dtype) or cell.dim() != col.ndim:
                    raise ContractError(
                        f"phase {phase!r} put column {name!r} as {cell.dtype} {cell.dim()}-D, "
                        f"but the contract declares {col.dtype} {col.shape}")
                break
            if name in self.active:  # a column no phase of this algorithm reads is not kept
                kept[name] = list(cells)
        return kept

    def put_rows(self, phase: str, columns: Mapping[str, Sequence[torch.Tensor]], *,
                 group_size: int, held: bool = False,
                 tags: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """New rows (every rank calls it; a rank with nothing to add passes ``{}``);
        ``held`` rows reach only gets that name them until released, ``tags`` are small
        per-row integers every rank can read (``TransferDock.put``)."""
        return self.dock.put(self._checked(phase, columns), num_rows_per_group=group_size,
                             held=held, tags=tags)

    def get(self, phase: str, columns: Sequence[str], rows_per_dp_rank: int, layout: str, *,
            consumer: str | None = None, whole_groups: bool = False,
            candidates: Sequence[int] | None = None) -> DockBatch | None:
        """``rows_per_dp_rank`` rows to each DP rank of ``layout`` (None where it takes no
        part). ``consumer`` defaults to the phase (a phase that reads the rows several
        times, e.g. one update per epoch, names each pass). ``candidates``: only these
        rows, at most ``rows_per_dp_rank`` each (``TransferDock.get``)."""
        for name in columns:
            self._column(phase, name, "get")
        batch = self.dock.get(consumer or phase, list(columns), rows_per_dp_rank,
                              self.layouts[layout], whole_groups=whole_groups,
                              candidates=candidates)
        if self.trace is not None and batch is not None:
            self.trace.setdefault(consumer or phase, []).extend(batch.rows)
        return batch

    def put(self, phase: str, batch: DockBatch | None,
            columns: Mapping[str, Sequence[torch.Tensor]]) -> None:
        """Results for the rows of ``batch`` (``None``: this rank received none and takes
        part with an empty put)."""
        kept = self._checked(phase, columns) if batch is not None else {}
        self.dock.put(kept, rows=batch.rows if kept else [])

    def retire(self, rows: Sequence[int]) -> None:
        """Drop ``rows`` (global ids; every rank passes the same) from the dock."""
        self.dock.retire(rows)

    def retire_all(self) -> dict[str, list[int]] | None:
        """The end of an iteration: drop every row but the held ones (partial rollout's
        carried rows); ids keep growing. Returns (and resets) the trace of this rank's
        gets, when tracing."""
        held = self.dock.rows(held=True)
        self.dock.retire(None if not len(held) else self.dock.rows(held=False))
        trace, self.trace = self.trace, ({} if self.trace is not None else None)
        return trace
