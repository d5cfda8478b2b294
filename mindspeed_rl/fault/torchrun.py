"""torchrun, ending with one line that says why a failed job failed.

    python -m mindspeed_rl.fault.torchrun --nproc_per_node 2 pretrain_grpo.py --config ...

Takes exactly torchrun's arguments and runs torchrun's own agent
(``torch.distributed.run``); only the end differs. Plain torchrun ends every failed job
with its agent's Python traceback (``ChildFailedError``, or ``RendezvousConnectionError``
on a node whose peer node died), printed after the error that matters. This wrapper
prints instead, as the last line:

- the root cause's own one-line error (the launchers write it to torchrun's per-rank
  error file; :mod:`mindspeed_rl.trainer.launch_guard`), preferring a rank's own error
  over the "lost its peer" reports of the ranks it left behind; or how a rank died
  (``rank 1 (pid ...) was killed by SIGKILL``);
- on a node whose rendezvous host went away: that the job's other node ended;
- after SIGTERM: the ranks' preemption line, exit 0 when every local rank saved and
  exited cleanly.

A rank stopped by SIGSTOP (or a debugger) cannot act on the SIGTERM with which torchrun
ends a failed job; the wrapper kills it 2 s after another rank of its node has exited
instead of letting torchrun wait its 30 s (:class:`StoppedRankReaper`).

Exit status: 0 on success or a clean preemption; the root cause's status on failure (2:
bad input, 1: a fault; 1 when the rank was killed by a signal); 128 + signal when the
agent itself was signalled and the ranks did not stop cleanly. The shell launchers in
``shell/`` use it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

# Where preempted ranks leave their line (read by launch_guard; kept here so that this
# module loads without torch, which must see TORCH_CPP_LOG_LEVEL first).
STATUS_DIR_ENV = "MINDSPEED_RL_STATUS_DIR"
_SECONDARY_MARKERS = ("lost its peer", "interrupted in phase")


def _message(failure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message or "")


def _has_error_file(failure) -> bool:
    """The rank wrote torchrun's error file (else torchrun shows ``<N/A>``)."""
    return bool(failure.error_file) and failure.error_file != "<N/A>"


def _describe_exit(rank: int, failure) -> str:
    if failure.exitcode < 0:
        return f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
    return f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}"


def _root_cause(failures: dict) -> tuple[int, object]:
    """The failure that explains the job: a rank's own error with a message, earliest
    first, before the reports of ranks that merely lost a peer, before bare exits."""
    def key(item):
        rank, failure = item
        message = _message(failure)
        has_own = _has_error_file(failure) and bool(message)
        secondary = any(m in message for m in _SECONDARY_MARKERS)
        return (not has_own, secondary, failure.timestamp, rank)

    return min(failures.items(), key=key)


def summarize_child_failure(error) -> str:
    """The last lines of a failed job: which ranks failed, then the cause."""
    rank, failure = _root_cause(error.failures)
    exits = ", ".join(_describe_exit(r, f) for r, f in sorted(error.failures.items()))
    message = _message(failure) if _has_error_file(failure) else ""
    head = f"torchrun: job failed ({exits})"
    if message:
        return f"{head}; the cause:\n{message.splitlines()[0]}"
    return f"{head}\ntorchrun: error: {_describe_exit(rank, failure)}"


class StoppedRankReaper:
    """Kill ranks that are stopped (SIGSTOP, a debugger) once the job is ending.

    torchrun ends a job whose rank failed by sending SIGTERM to the other ranks and SIGKILL
    30 s later; a stopped rank cannot act on SIGTERM, so those 30 s are only waiting. Once
    any rank of this node has exited, a rank that stays stopped for ``grace_s`` is killed.
    Running ranks are left to torchrun: they may be writing their own one-line error.
    """

    def __init__(self, grace_s: float = 2.0, poll_s: float = 0.5) -> None:
        import threading

        self.grace_s, self.poll_s = grace_s, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stopped-rank-reaper",
                                        daemon=True)

    def __enter__(self) -> "StoppedRankReaper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1)

    def _run(self) -> None:
        import time

        import psutil

        agent = psutil.Process()
        seen: set[int] = set()
        stopped_since: dict[int, float] = {}
        while not self._stop.wait(self.poll_s):
            ranks = {p.pid: p for p in agent.children()}  # torchrun starts ranks directly
            ending = bool(seen - ranks.keys())
            seen |= ranks.keys()
            now = time.monotonic()
            for pid, rank in ranks.items():
                try:
                    stopped = rank.status() == psutil.STATUS_STOPPED
                except psutil.NoSuchProcess:
                    continue
                if not (ending and stopped):
                    stopped_since.pop(pid, None)
                elif now - stopped_since.setdefault(pid, now) >= self.grace_s:
                    print(f"torchrun: killing pid {pid}: stopped, it cannot act on SIGTERM",
                          file=sys.stderr, flush=True)
                    try:
                        rank.kill()
                    except psutil.NoSuchProcess:
                        pass


def main(argv: list[str] | None = None) -> int:
    from mindspeed_rl.metrics.console import verbose

    if not verbose() and "torch" not in sys.modules:
        # The agent's TCPStore client logs C++ warnings with stack frames when a peer node
        # goes away; the line below says it plainly. Read by torch's C++ logging when torch
        # loads, and removed again so the ranks keep their own C++ warnings.
        had = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        import torch  # noqa: F401 - loads c10 while the variable is set

        if had is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = had
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun sets OMP_NUM_THREADS=1 for the ranks when it is unset, with a banner each
    # time; the same default, without the banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    status_dir = tempfile.mkdtemp(prefix="mindspeed_rl_status_")
    os.environ[STATUS_DIR_ENV] = status_dir  # the workers inherit it
    try:
        with StoppedRankReaper():
            run(args)
        return 0
    except ChildFailedError as error:
        print(summarize_child_failure(error), file=sys.stderr, flush=True)
        _, cause = _root_cause(error.failures)
        return cause.exitcode if cause.exitcode > 0 else 1
    except SignalException as error:
        saved = sorted(name for name in os.listdir(status_dir) if name.startswith("preempted."))
        local_ranks = int(str(args.nproc_per_node)) if str(args.nproc_per_node).isdigit() else 0
        name = signal.Signals(error.sigval).name
        if saved and len(saved) >= local_ranks:
            with open(os.path.join(status_dir, saved[0])) as f:
                print(f.read().strip(), file=sys.stderr, flush=True)
            return 0
        print(f"torchrun: error: stopped by {name} before the ranks finished saving",
              file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    except RendezvousError as error:
        endpoint = getattr(args, "rdzv_endpoint", "") or f"{args.master_addr}:{args.master_port}"
        print(f"torchrun: error: this node lost the job's rendezvous at {endpoint} "
              f"({type(error).__name__}): the node that hosted it ended, so a rank or "
              "the agent failed there (see that node's last line); this node's ranks were "
              "stopped", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
