"""Phase timers: wall seconds per named phase of an iteration, logged as ``timing/<phase>``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

# Called as observer(phase name, "enter" | "exit" | "fail") around every phase of every Timers
# (e.g. the fault module's phase tracker, which names the phase a failed collective
# was in). An observer may raise on "enter" to stop before the phase starts.
PhaseObserver = Callable[[str, str], None]
_observers: list[PhaseObserver] = []


def add_phase_observer(observer: PhaseObserver) -> None:
    """Have ``observer(name, event)`` called on every phase enter/exit (idempotent)."""
    if observer not in _observers:
        _observers.append(observer)


def remove_phase_observer(observer: PhaseObserver) -> None:
    if observer in _observers:
        _observers.remove(observer)


class Timers:
    """Accumulates wall-clock seconds per phase until :meth:`pop`.

    ``with timers.phase("rollout"): ...`` adds the elapsed time to
    ``timing/rollout``; entering the same phase again in one iteration adds to it
    (e.g. one ``update`` per mini-batch). Phases nest (``all`` around everything,
    ``rollout`` inside it); each nested phase is timed on its own, so nested
    timings are not additive.

    Args:
        synchronize: called when a phase starts and ends, e.g.
            ``torch.cuda.synchronize``, so that asynchronous device work launched
            inside the phase is charged to it rather than to the next one.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self._synchronize = synchronize
        self._elapsed_s: dict[str, float] = {}
        self._running: set[str] = set()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` body under ``timing/<name>`` (also when it raises)."""
        if name in self._running:
            # A phase nested in itself would count its inner time twice.
            raise ValueError(f"timer phase {name!r} is already running; phases cannot nest "
                             f"inside themselves")
        for observer in list(_observers):
            observer(name, "enter")
        self._running.add(name)
        if self._synchronize is not None:
            self._synchronize()
        start = time.perf_counter()
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            if self._synchronize is not None:
                self._synchronize()
            key = f"timing/{name}"
            self._elapsed_s[key] = self._elapsed_s.get(key, 0.0) + time.perf_counter() - start
            self._running.discard(name)
            for observer in list(_observers):
                observer(name, "fail" if failed else "exit")

    def pop(self) -> dict[str, float]:
        """Return ``{"timing/<phase>": seconds}`` of the finished phases and reset them.

        Phases still running are not included; they are reported by the next
        ``pop`` after they end.
        """
        elapsed, self._elapsed_s = self._elapsed_s, {}
        return elapsed
