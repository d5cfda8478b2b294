"""Recognise a failed collective and say, in one line, where it happened and who is lost."""

from __future__ import annotations

from collections.abc import Iterator

# What gloo, NCCL, HCCL and the c10d store say when a peer does not answer or is gone.
_TIMEOUT_MARKERS = ("Timed out waiting", "timed out", "Socket Timeout",
                    "Watchdog caught collective operation timeout")
_LOST_PEER_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "Connection refused", "NCCL communicator was aborted",
                      "remote process exited or there was a network error")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes and contexts, and the per-rank errors torch's checkpoint
    exceptions wrap (``failures``)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def collective_failure_kind(exc: BaseException) -> str | None:
    """``"timeout"``, ``"lost peer"`` or None (not a failed collective)."""
    import torch.distributed as dist

    from mindspeed_rl.errors import TransferDockTimeoutError

    kind = None
    for e in _chain(exc):
        text = str(e)
        if any(m in text for m in _TIMEOUT_MARKERS):
            return "timeout"
        if any(m in text for m in _LOST_PEER_MARKERS):
            return "lost peer"
        if isinstance(e, (TransferDockTimeoutError, dist.DistError)):
            kind = "timeout"
    return kind


def _dock_call(exc: BaseException) -> str | None:
    from mindspeed_rl.errors import TransferDockTimeoutError

    for e in _chain(exc):
        if isinstance(e, TransferDockTimeoutError):
            return getattr(e, "call", None)
    return None


def describe_collective_failure(exc: BaseException, tracker, timeout_s: float,
                                startup_timeout_s: float | None = None) -> str:
    """One line: this rank, the phase and iteration, what failed, and the lost rank(s).
    A timeout in the phase ``startup`` names the start-up bound (``startup_timeout_s``,
    when given) instead of ``timeout_s``.

    Reads the other ranks' published state (:meth:`PhaseTracker.peers`), which takes a
    few heartbeats.
    """
    kind = collective_failure_kind(exc) or "timeout"
    phase, iteration = tracker.failed_phase or (tracker.phase, tracker.iteration)
    where = f"phase '{phase}'" + (f" of iteration {iteration}" if iteration else "")
    dock = _dock_call(exc)
    what = f"a TransferDock {dock}" if dock else "a collective"
    if kind == "timeout" and phase == "startup" and startup_timeout_s is not None:
        cause = (f"{what} in {where} got no answer within the start-up bound of "
                 f"{startup_timeout_s:g} s (rl_config.startup_timeout_s)")
    elif kind == "timeout":
        cause = (f"{what} in {where} got no answer within rl_config.collective_timeout_s="
                 f"{timeout_s:g} s")
    else:
        cause = f"{what} in {where} lost its peer (a rank crashed, was killed or lost its node)"
    peers = tracker.peers()
    silent = [p for p in peers if p.responding is False]
    elsewhere = [p for p in peers if p.responding and (p.phase, p.iteration) != (phase, iteration)]
    if silent:
        lost = "; not responding: " + ", ".join(p.describe() for p in silent)
    elif elsewhere:
        lost = "; stuck elsewhere: " + ", ".join(p.describe() for p in elsewhere)
    elif not peers:
        lost = "; the lost rank is unknown (the job's store cannot be read)"
    else:
        lost = ""
    return (f"rank {tracker.rank}: {cause}{lost}; stopping (resume from the last checkpoint "
            "with actor_config.load)")
