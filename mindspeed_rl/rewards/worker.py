"""A reward worker process: ``python -m mindspeed_rl.rewards.worker READ_FD WRITE_FD
PARENT_PID [MODULE ...]``, started by :class:`mindspeed_rl.rewards.verifier_pool.RewardPool`.

It imports the modules that register the job's verifiers, answers ``("ready", names)``,
then for each ``(call, verifier, response, answer)`` replies ``(call, True, score)`` or
``(call, False, "ExceptionType: message")``; ``None`` or a closed pipe ends it. It
ignores SIGINT and SIGTERM: a preempted rank finishes its iteration and needs its
rewards; the rank kills its workers, and Linux kills them when the rank dies.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
from multiprocessing.connection import Connection


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the rank that started it ends (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the rank ended before the request took effect
        os._exit(0)


def serve(conn_in: Connection, conn_out: Connection, modules: list[str]) -> None:
    try:
        for module in modules:
            importlib.import_module(module)
        from mindspeed_rl.rewards.registry import get_verifier, registered_verifiers
    except BaseException as error:  # noqa: BLE001 - reported to the rank, which raises
        conn_out.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn_out.send(("ready", registered_verifiers()))
    while True:
        try:
            task = conn_in.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        call, name, response, answer = task
        try:
            reply = (call, True, float(get_verifier(name)(response, answer)))
        except BaseException as error:  # noqa: BLE001 - math-verify's timeout is a BaseException
            reply = (call, False, f"{type(error).__name__}: {error}"[:300])
        conn_out.send(reply)


def main(argv: list[str]) -> None:
    read_fd, write_fd, parent_pid, modules = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False), modules)


if __name__ == "__main__":
    main(sys.argv[1:])
