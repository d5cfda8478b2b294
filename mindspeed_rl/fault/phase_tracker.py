"""Which phase of which iteration every rank is in, readable by the others after a failure.

A rank waiting in a collective cannot tell why its peer does not arrive: gloo says
only "Timed out waiting 5000ms for recv". So every rank publishes, in the job's
key-value store (torchrun's TCPStore; the FileStore of the multi-process tests):

- ``phase/<rank>``: ``"<iteration>|<phase>"``, rewritten whenever it enters or leaves a
  phase of the trainer's :class:`~mindspeed_rl.metrics.Timers`;
- ``beat/<rank>``: a counter a daemon thread bumps every ``heartbeat_s``.

When a collective fails, the survivor reads both (:meth:`PhaseTracker.peers`): a
rank whose counter stopped is stopped or dead (SIGSTOP, SIGKILL, a lost node); a
rank whose counter goes on but whose phase differs from the survivor's is stuck
elsewhere (a deadlock, a stuck filesystem). The store lives in torchrun's agent,
not in the ranks, so it outlives a hung or killed rank.

The iteration count follows the phase named :data:`ITERATION_PHASE` (the trainer's
``all``, which wraps one whole iteration): each entry starts the next iteration, and
callbacks registered with :meth:`PhaseTracker.on_iteration_start` (preemption) run
right before it, when no work of that iteration has been done.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from mindspeed_rl.fault import injection
from mindspeed_rl.metrics.timers import add_phase_observer, remove_phase_observer

ITERATION_PHASE = "all"  # the timed phase that wraps one trainer iteration
_PREFIX = "mindspeed_rl/fault/"


@dataclass(frozen=True)
class PeerState:
    """What the store says about one rank after a failure."""

    rank: int
    iteration: int
    phase: str
    responding: bool | None  # heartbeat advanced while we watched; None: unknown
    host: str = ""
    pid: int = 0

    def describe(self) -> str:
        where = f"phase '{self.phase}'" + (f" of iteration {self.iteration}"
                                           if self.iteration else "")
        return f"rank {self.rank} ({where}; pid {self.pid} on {self.host})"


class PhaseTracker:
    """This rank's current phase and iteration, published for the others (module docstring)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.iteration = 0
        self._stack: list[str] = []
        self._last: str | None = None
        self._failed: tuple[str, int] | None = None
        self._store = None
        self.heartbeat_s = 1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._iteration_callbacks: list[Callable[[int], None]] = []

    # ---- life cycle --------------------------------------------------------------
    def start(self, *, heartbeat_s: float = 1.0, store=None) -> None:
        """Publish this rank's state and start its heartbeat (after init_process_group).

        Every rank of the job calls this; ``store`` defaults to the world group's store.
        """
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(_PREFIX, store)
        self.heartbeat_s = float(heartbeat_s)
        self._store.set(f"host/{self.rank}", f"{socket.gethostname()}|{os.getpid()}")
        self._store.add(f"beat/{self.rank}", 1)
        self._publish()
        add_phase_observer(self.on_phase)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="mindspeed_rl-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat and stop following phases (at teardown)."""
        remove_phase_observer(self.on_phase)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s + 1)
            self._thread = None

    def on_iteration_start(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(next_iteration)`` on every rank right before each iteration starts;
        it may raise to stop before any work of that iteration is done."""
        if callback not in self._iteration_callbacks:
            self._iteration_callbacks.append(callback)

    # ---- the phase ---------------------------------------------------------------
    @property
    def phase(self) -> str:
        """The innermost running phase, else where the rank is between phases."""
        if self._stack:
            return self._stack[-1]
        if self._last is None:
            return "startup"
        return f"after {self._last}"

    @property
    def failed_phase(self) -> tuple[str, int] | None:
        """(phase, iteration) the first exception escaped from since the last :meth:`enter`."""
        return self._failed

    def enter(self, name: str) -> None:
        """Enter a phase (the Timers observer calls this; launchers call it for phases
        outside the trainer's timers, such as ``startup``)."""
        if name == ITERATION_PHASE:
            for callback in list(self._iteration_callbacks):
                callback(self.iteration + 1)
            self.iteration += 1
        self._failed = None
        self._stack.append(name)
        self._publish()
        injection.at_phase(name, self.rank, self.iteration)

    def exit(self, name: str, failed: bool = False) -> None:
        if failed and self._failed is None:  # innermost first: keep where it started
            self._failed = (name, self.iteration)
        if name in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name)]
        self._last = name
        self._publish()

    def on_phase(self, name: str, event: str) -> None:
        """:func:`mindspeed_rl.metrics.timers.add_phase_observer` callback."""
        if event == "enter":
            self.enter(name)
        else:
            self.exit(name, failed=event == "fail")

    # ---- the store -----------------------------------------------------------------
    def _publish(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"phase/{self.rank}", f"{self.iteration}|{self.phase}")
        except Exception:  # noqa: BLE001 - the store's host is gone; the failure path reports it
            self._store = None

    def _beat(self) -> None:
        store = self._store
        while not self._stop.wait(self.heartbeat_s):
            try:
                store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing to publish to
                return

    def first_to_claim(self, key: str) -> bool:
        """True on the first rank of the job to claim ``key`` (e.g. to print a message that
        every rank would print alike); True everywhere when the store cannot be reached."""
        if self._store is None:
            return True
        try:
            return self._store.add(f"claim/{key}", 1) == 1
        except Exception:  # noqa: BLE001 - no store: let every rank speak
            return True

    def peers(self, watch_s: float | None = None, deadline_s: float = 10.0) -> list[PeerState]:
        """Every other rank's published state; ``responding`` from watching the heartbeats
        for ``watch_s`` (default 2.5 heartbeats). Empty when the store cannot be read
        within ``deadline_s`` or its host dies during the read (it lives in a node's
        torchrun agent, which ends with that node)."""
        if self._store is None:
            return []
        watch_s = 2.5 * self.heartbeat_s if watch_s is None else watch_s
        result: list[PeerState] = []
        lost: list[Exception] = []

        def read() -> None:
            store, others = self._store, [r for r in range(self.world_size) if r != self.rank]
            try:
                known = [r for r in others if store.check([f"beat/{r}"])]
                before = {r: store.add(f"beat/{r}", 0) for r in known}
                time.sleep(watch_s)
                for r in known:
                    text = (store.get(f"phase/{r}").decode() if store.check([f"phase/{r}"])
                            else "0|?")
                    iteration, _, phase = text.partition("|")
                    host, _, pid = (store.get(f"host/{r}").decode()
                                    if store.check([f"host/{r}"]) else "?|0").partition("|")
                    result.append(PeerState(r, int(iteration), phase,
                                            store.add(f"beat/{r}", 0) != before[r], host,
                                            int(pid)))
            except Exception as error:  # noqa: BLE001 - the store's host died mid-read
                lost.append(error)

        reader = threading.Thread(target=read, name="mindspeed_rl-peers", daemon=True)
        reader.start()
        reader.join(deadline_s + watch_s)
        return result if not reader.is_alive() and not lost else []


tracker = PhaseTracker()
"""This process's tracker (one rank per process)."""


def injection_point(name: str) -> None:
    """An explicit injection point inside a phase (e.g. ``checkpoint_write``): the test hook
    of mindspeed_rl/fault/injection.py at this rank and iteration (no-op when unset)."""
    if not os.environ.get(injection.ENV):
        return
    injection.at_phase(name, tracker.rank, tracker.iteration)
