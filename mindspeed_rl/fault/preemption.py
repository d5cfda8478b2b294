"""Preemption: SIGTERM ends the run at the next iteration boundary, after a checkpoint.

Schedulers (SLURM, Kubernetes) send SIGTERM some seconds before SIGKILL; torchrun
forwards it to every worker and sends SIGKILL 30 s later. Ranks receive the signal at
different moments, so none may act on it alone:

- the first SIGTERM only sets a flag (at once, from a watcher thread, even while the
  main thread is blocked inside a collective);
- right before each iteration starts, every rank contributes its flag to one small
  all-reduce (MAX) over a gloo group: all ranks see the same verdict, and when any
  rank was signalled every rank raises :class:`Preempted` before doing any work of
  that iteration. The launcher then writes a checkpoint (when ``actor_config.save``
  is set and the tracker file does not already name that iteration, as rank 0 reads
  it: the verdict is broadcast, so the ranks save together or all skip) and exits 0. So a SIGTERM costs at most the rest of the current iteration
  plus one checkpoint save;
- a second SIGTERM, more than :data:`REPEAT_AFTER_S` after the first, exits at once
  (status 143). Signals closer together count once: SLURM signals every process of
  the step *and* torchrun forwards the same request.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

REPEAT_AFTER_S = 2.0
EXIT_AT_ONCE = 128 + signal.SIGTERM


class Preempted(Exception):
    """Every rank agreed to stop before iteration ``next_iteration`` (a SIGTERM arrived)."""

    def __init__(self, next_iteration: int):
        super().__init__(f"stopped by SIGTERM before iteration {next_iteration}")
        self.next_iteration = next_iteration


class Preemption:
    """The SIGTERM flag of this rank and the all-rank agreement on it."""

    def __init__(self) -> None:
        self.first_signal_at: float | None = None
        self._group = None
        self._read_fd = self._write_fd = -1
        self._old_handler = None
        self._old_wakeup_fd = -1
        self._watcher: threading.Thread | None = None

    @property
    def requested(self) -> bool:
        """A SIGTERM reached this rank (its own view; see :meth:`agree`)."""
        return self.first_signal_at is not None

    def install(self, timeout_s: float) -> None:
        """Handle SIGTERM from now on (main thread, every rank; creates a gloo group, so
        every rank calls it at the same point)."""
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        # Python runs signal handlers between bytecodes of the main thread, which may sit
        # in a collective for minutes; the wakeup fd is written by the C-level handler at
        # once, and the watcher thread acts on it.
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="mindspeed_rl-sigterm",
                                         daemon=True)
        self._watcher.start()

    def uninstall(self) -> None:
        """Restore the previous SIGTERM handling (at teardown)."""
        if self._watcher is None:
            return
        signal.set_wakeup_fd(self._old_wakeup_fd)
        signal.signal(signal.SIGTERM, self._old_handler or signal.SIG_DFL)
        os.close(self._write_fd)  # ends the watcher's read
        self._watcher.join(timeout=2)
        os.close(self._read_fd)
        self._watcher = None

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data:
                continue
            now = time.monotonic()
            if self.first_signal_at is None:
                self.first_signal_at = now
                print(f"[rank {dist.get_rank()}] SIGTERM: finishing the current iteration, "
                      "then saving and exiting (send SIGTERM again to exit at once)",
                      file=sys.stderr, flush=True)
            elif now - self.first_signal_at > REPEAT_AFTER_S:
                print(f"[rank {dist.get_rank()}] second SIGTERM: exiting at once",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_AT_ONCE)

    def agree(self) -> bool:
        """Collective: True on every rank when any rank has seen a SIGTERM."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def decide(self, verdict: int) -> int:
        """Collective: rank 0's ``verdict`` on every rank. A decision every rank must act
        on together (whether to save) is taken once, where file reads can differ between
        nodes (a node-local or lagging tracker file), and sent to the others."""
        box = torch.tensor([verdict], dtype=torch.int32)
        dist.broadcast(box, src=0, group=self._group)
        return int(box.item())

    def check(self, next_iteration: int) -> None:
        """The iteration-boundary hook: raise :class:`Preempted` on every rank alike."""
        if self._group is not None and self.agree():
            raise Preempted(next_iteration)


preemption = Preemption()
"""This process's SIGTERM state."""
