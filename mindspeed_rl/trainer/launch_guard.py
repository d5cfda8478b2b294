"""What a launcher does when its run ends early: one line, the right exit status, no hang.

Every launcher (``pretrain_grpo.py``, and the PPO one after it) wraps its run in a
:class:`LaunchGuard`::

    guard = LaunchGuard("pretrain_grpo.py", config)   # after init_distributed
    try:
        trainer = GRPOTrainer(...)
        guard.training_starts(trainer.iteration)
        trainer.train()
    except BaseException as error:
        return guard.failed(error, save_checkpoint=...)
    finally:
        guard.teardown(...)

:meth:`LaunchGuard.failed` sorts the exception:

======================  ==========================================  ======
kind                    what the user sees                          status
======================  ==========================================  ======
preempted (SIGTERM)     checkpoint written, one line                0
bad input               ``<prog>: error: <message>``, once per job  2
failed collective       one line per surviving rank: the phase,     1
                        the iteration, the lost rank
NaN/Inf, full disk,     ``<prog>: error: <message>``, once per job  1
checkpoint, dock
anything else (a bug)   the traceback                               1
======================  ==========================================  ======

Failures end the process with ``os._exit`` after flushing and stopping the rank's helper
processes (reward workers, megatron-core's checkpoint queue manager): the normal teardown
(vLLM's engine, process groups) may wait on the lost rank. The line is also written
to torchrun's per-rank error file (``TORCHELASTIC_ERROR_FILE``), so torchrun's own
summary and :mod:`mindspeed_rl.fault.torchrun` show it as the root cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from mindspeed_rl.fault.collective import collective_failure_kind, describe_collective_failure
from mindspeed_rl.fault.phase_tracker import tracker
from mindspeed_rl.fault.preemption import Preempted, preemption

BAD_INPUT_EXIT = 2
FAILURE_EXIT = 1
INTERRUPTED_EXIT = 130
from mindspeed_rl.fault.torchrun import STATUS_DIR_ENV  # noqa: E402 - set by the wrapper


def _bad_input_types() -> tuple[type[BaseException], ...]:
    # ValueError covers ConfigError, LayoutError, RolloutConfigError, ReshardingError and the
    # unsupported-model errors; the OSErrors are files that are missing, unreadable or in
    # the way.
    from mindspeed_rl.errors import CheckpointError

    return (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, FileExistsError, CheckpointError)


def _one_line_failure_types() -> tuple[type[BaseException], ...]:
    from mindspeed_rl.fault.nonfinite import NonFiniteError
    from mindspeed_rl.transfer_dock import TransferDockError

    return (NonFiniteError, TransferDockError, OSError)


def write_error_file(message: str, callstack: str | None = None) -> None:
    """Give torchrun this rank's error (it reads ``TORCHELASTIC_ERROR_FILE`` when the rank
    exits non-zero and shows the message as the failure's traceback)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack or message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def report_config_error(prog: str, error: BaseException) -> int:
    """A config error found before any process group exists: every rank has the same one;
    rank 0 prints it."""
    message = f"{prog}: error: {error}"
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    write_error_file(message)
    return BAD_INPUT_EXIT


def _exit(code: int) -> None:
    """End the rank now, but not its helper processes with it: multiprocessing's
    finalizers run first (what a normal exit runs first too): they stop the reward workers
    and the queue-manager process megatron-core's checkpoint writer starts at the first
    save, which would otherwise live on as an orphan (a ~270 MB process per rank, for
    good). Each is bounded: a kill, or a shutdown message then ``terminate``."""
    import multiprocessing.util

    try:
        multiprocessing.util._run_finalizers(0)
    except Exception:  # noqa: BLE001 - the exit status and the line already said it all
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Whether a preempted run saves (rank 0's verdict, broadcast).
_SAVE, _ALREADY_SAVED, _NOTHING_RAN, _NO_SAVE_DIR = range(4)


class LaunchGuard:
    """Fault handling of one launcher run (module docstring)."""

    def __init__(self, prog: str, config) -> None:
        from mindspeed_rl.parallel.groups import startup_bound

        self.prog = prog
        self.timeout_s = float(config.rl_config.collective_timeout_s)
        self.startup_timeout_s = startup_bound(self.timeout_s, config.rl_config.startup_timeout_s)
        self.save_dir = config.actor_config.save
        # Heartbeats fast enough that a survivor tells a silent rank from a busy one well
        # within the timeout, slow enough to cost nothing on a large job.
        tracker.start(heartbeat_s=min(10.0, max(0.2, self.timeout_s / 20)))
        tracker.enter("startup")

    def training_starts(self, iteration: int) -> None:
        """The trainer is built (start-up is over: every collective waits
        ``collective_timeout_s`` from now on) and resumes after ``iteration``: arm SIGTERM
        handling."""
        tracker.exit("startup")
        tracker.iteration = iteration
        self.first_iteration = iteration
        preemption.install(self.timeout_s)
        tracker.on_iteration_start(preemption.check)

    def _print_once(self, message: str) -> None:
        """Print ``message`` on the first rank that reports it (the ranks of a job
        usually fail alike on bad input; asymmetric failures still print)."""
        if tracker.first_to_claim("error/" + hashlib.sha1(message.encode()).hexdigest()[:16]):
            print(message, file=sys.stderr, flush=True)

    def failed(self, error: BaseException,
               save_checkpoint: Callable[[], object] | None = None) -> int:
        """Handle the exception that ended the run; returns the exit status (0 after a
        preemption) or ends the process."""
        if isinstance(error, SystemExit):
            raise error
        if isinstance(error, Preempted):
            return self._preempted(error, save_checkpoint)
        if isinstance(error, KeyboardInterrupt):
            message = f"{self.prog}: interrupted in phase '{tracker.phase}'"
            print(message, file=sys.stderr, flush=True)
            write_error_file(message)
            _exit(INTERRUPTED_EXIT)
        if collective_failure_kind(error) is not None:
            message = f"{self.prog}: error: " + describe_collective_failure(
                error, tracker, self.timeout_s, self.startup_timeout_s)
            print(message, file=sys.stderr, flush=True)
            write_error_file(message)
            _exit(FAILURE_EXIT)
        if os.environ.get("MINDSPEED_RL_DEBUG"):
            traceback.print_exc()
        if isinstance(error, _bad_input_types()):
            message = f"{self.prog}: error: {error}"
            self._print_once(message)
            write_error_file(message)
            _exit(BAD_INPUT_EXIT)
        if isinstance(error, _one_line_failure_types()):
            message = f"{self.prog}: error: {type(error).__name__}: {error}"
            self._print_once(message)
            write_error_file(message)
            _exit(FAILURE_EXIT)
        text = "".join(traceback.format_exception(error))
        if preemption.requested:
            # The agent is stopping this rank (another node failed, or the job was
            # cancelled) and what ran was cut off mid-way (a kernel compile, a store the
            # other node hosted): a consequence, said in one line; the trace goes to the
            # error file (MINDSPEED_RL_DEBUG=1 prints it).
            first = (str(error).strip().splitlines() or [""])[0][:300]
            message = (f"{self.prog}: error: stopped by SIGTERM in phase '{tracker.phase}'; "
                       f"while stopping: {type(error).__name__}: {first}")
            print(message, file=sys.stderr, flush=True)
            write_error_file(message, text)
            _exit(FAILURE_EXIT)
        print(text, file=sys.stderr, end="", flush=True)
        write_error_file(f"{self.prog}: {type(error).__name__}: {error}", text)
        _exit(FAILURE_EXIT)
        return FAILURE_EXIT  # not reached

    def _save_verdict(self, done: int, can_save: bool) -> int:
        """Rank 0's reading of whether to save, the same on every rank (preemption.decide)."""
        verdict = _SAVE
        if done <= self.first_iteration:
            verdict = _NOTHING_RAN
        elif not (self.save_dir and can_save):
            verdict = _NO_SAVE_DIR
        elif tracker.rank == 0:
            from mindspeed_rl.checkpoint.tracker import read_tracker
            from mindspeed_rl.errors import CheckpointError

            try:
                if read_tracker(self.save_dir) == done:
                    verdict = _ALREADY_SAVED
            except CheckpointError:  # none yet, or damaged: save (it rewrites the tracker)
                pass
        return preemption.decide(verdict)

    def _preempted(self, stop: Preempted, save_checkpoint) -> int:
        done = stop.next_iteration - 1
        verdict = self._save_verdict(done, save_checkpoint is not None)
        if verdict in (_SAVE, _ALREADY_SAVED):
            if verdict == _SAVE:
                tracker.enter("checkpoint")
                save_checkpoint()
                tracker.exit("checkpoint")
            saved = f"; checkpoint of iteration {done} in {self.save_dir}"
        elif verdict == _NOTHING_RAN:
            saved = "; no iteration ran, nothing to save"
        else:
            saved = "; actor_config.save is not set, nothing saved"
        message = f"{self.prog}: stopped by SIGTERM after iteration {done}{saved}"
        if tracker.rank == 0:
            print(message, file=sys.stderr, flush=True)
        status_dir = os.environ.get(STATUS_DIR_ENV)
        if status_dir:
            try:
                with open(os.path.join(status_dir, f"preempted.{tracker.rank}"), "w") as f:
                    f.write(message + "\n")
            except OSError:
                pass
        return 0

    def teardown(self, release: Callable[[], None]) -> None:
        """Normal end (or after a preemption): stop fault handling, then ``release()``."""
        preemption.uninstall()
        tracker.stop()
        release()
