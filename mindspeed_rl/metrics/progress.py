"""Progress bars shown by rank 0 only (every rank runs the same loop under torchrun)."""

from __future__ import annotations

import sys
from typing import Iterable

from tqdm import tqdm

# On a terminal the bar redraws in place; redirected to a log file every redraw is a
# new line, so redraw rarely there.
_MININTERVAL_TTY_S = 0.5
_MININTERVAL_FILE_S = 30.0


def rank0_progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                   rank: int, enabled: bool = True, unit: str = "it",
                   leave: bool = True) -> tqdm:
    """A tqdm progress bar drawn on rank 0 and silent on the other ranks.

    Use it to wrap the iteration loop (``for it in rank0_progress(range(n), ...)``)
    or manually for rollout progress (``bar = rank0_progress(total=n, ...)``,
    ``bar.update(k)``, ``bar.close()``); it is also a context manager. On other
    ranks, or with ``enabled=False``, it is a disabled tqdm: iterating and
    ``update`` still work and print nothing.

    Args:
        iterable: what to iterate over, or None for a manual bar.
        total: number of steps (taken from ``len(iterable)`` when it has one).
        desc: label before the bar.
        rank: this process's global rank.
        enabled: False turns the bar off on every rank (e.g. a config switch).
        unit: name of one step, e.g. ``"it"`` or ``"sample"``.
        leave: keep the finished bar on screen.
    """
    stream = sys.stderr
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, file=stream,
                disable=not (enabled and rank == 0), dynamic_ncols=True,
                mininterval=_MININTERVAL_TTY_S if is_tty else _MININTERVAL_FILE_S)
