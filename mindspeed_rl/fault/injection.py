"""Fault injection: a TEST HOOK that makes one rank fail at a named point.

Set ``MINDSPEED_RL_FAULT_INJECT`` to one or more comma-separated specs::

    <point>:<rank>[:<iteration>[:<action>]]

- ``point``: a trainer phase (``rollout``, ``resharding_to_infer``, ``resharding_to_train``,
  ``reward``, ``adv``, ``old_log_p``, ``reference_model``, ``update``, ``checkpoint``,
  ``all``, ``startup``) — the rank acts right after entering it and publishing it — or an
  explicit point inside a phase (``injection_point`` in fault/phase_tracker.py, which knows the
  rank and iteration): ``checkpoint_write`` (after this rank wrote its shards, before the
  ranks agree the save is complete).
- ``rank``: the global rank that fails; ``iteration``: only in that iteration (default:
  the first time the point is reached).
- ``action``: ``stop`` (SIGSTOP itself: a hung rank, the default), ``kill`` (SIGKILL
  itself: a crashed rank), ``enospc`` (raise ``OSError(ENOSPC)``: a full disk).

The fault tests (tests/test_faults.py) use it to hang or kill a rank in each phase
under torchrun. Nothing reads it unless it is set; never set it in a real run.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

ENV = "MINDSPEED_RL_FAULT_INJECT"
ACTIONS = ("stop", "kill", "enospc")


@dataclass(frozen=True)
class FaultSpec:
    point: str
    rank: int
    iteration: int | None = None
    action: str = "stop"


def parse(text: str) -> list[FaultSpec]:
    """The specs of ``MINDSPEED_RL_FAULT_INJECT`` (ValueError naming the bad one)."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        try:
            if not 2 <= len(fields) <= 4 or fields[3:4] and fields[3] not in ACTIONS:
                raise ValueError
            specs.append(FaultSpec(fields[0], int(fields[1]),
                                   int(fields[2]) if len(fields) > 2 and fields[2] else None,
                                   fields[3] if len(fields) > 3 else "stop"))
        except ValueError:
            raise ValueError(f"{ENV}: bad spec {item!r}; expected "
                             f"<point>:<rank>[:<iteration>[:{'|'.join(ACTIONS)}]]") from None
    return specs


_fired: set[FaultSpec] = set()


def _act(spec: FaultSpec, iteration: int) -> None:
    _fired.add(spec)
    # The tests time the other ranks' reaction from this line.
    print(f"[fault injection] rank {spec.rank}: {spec.action} at '{spec.point}' of iteration "
          f"{iteration} (t={time.time():.3f})", file=sys.stderr, flush=True)
    if spec.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV} at "
                                    f"{spec.point})")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSTOP if spec.action == "stop" else signal.SIGKILL)


def at_phase(point: str, rank: int, iteration: int) -> None:
    """Fail here if a spec names this point, rank and iteration (no-op when unset)."""
    text = os.environ.get(ENV)
    if not text:
        return
    for spec in parse(text):
        if (spec.point == point and spec.rank == rank and spec not in _fired
                and spec.iteration in (None, iteration)):
            _act(spec, iteration)
