"""The one bootstrap of every launcher (pretrain_grpo.py, pretrain_ppo.py) and of
benchmarks/bench_grpo.py: config and plan before any process group, then platform,
process groups, the trainer, and the teardown in ``finally``."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from typing import Iterator, NoReturn, Sequence, TextIO


_PR_SET_DUMPABLE = 4


def make_non_dumpable() -> bool:
    """Mark this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``, Linux): a process
    without CAP_SYS_PTRACE, even of the same user (a tool call run without its sandbox, any
    child), can no longer ptrace the trainer, read or write its memory
    (``/proc/<pid>/mem``) or read its environment (``/proc/<pid>/environ``), and no core
    file is written. Each rank sets it for itself (an exec resets it). True when set."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_process(code: int) -> NoReturn:
    """End a launcher's process as the interpreter would, minus its finalization.

    What a normal exit does that matters is done here, in its order: wait for the threads
    that are not daemons, run the ``atexit`` handlers (multiprocessing's children, logging,
    vLLM's and torch's hooks), flush stdout and stderr. What is skipped is freeing every
    object of torch, megatron-core, vLLM and transformers one by one: 2.6 s per rank
    measured on a 2-core CPU machine for the tiny GRPO job, about a tenth of its launch,
    with nothing to write anymore (the trainer's files are closed by its teardown)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _release(trainer) -> None:
    """The teardown of a run whose process ends next: everything allocated so far is moved
    out of the garbage collector's sight first (``gc.freeze``), so the full collections
    vLLM's engine shutdown makes (0.9 s per rank measured) scan nothing; the process's
    memory is returned at exit anyway."""
    from mindspeed_rl.parallel.groups import teardown_distributed

    gc.freeze()
    teardown_distributed(trainer.close if trainer is not None else None)


def _build_trainer(config, plan, platform):
    """The trainer, built after the objects of the imports so far (torch, megatron-core,
    transformers: most of the process's objects, all kept to the end) are moved out of the
    garbage collector's sight: vLLM's engine build runs full collections (0.7 s per rank
    less measured on the tiny GRPO job). Start-up ends with it (groups.end_startup)."""
    from mindspeed_rl.parallel.groups import end_startup
    from mindspeed_rl.trainer.trainer import RLTrainer

    gc.freeze()
    trainer = RLTrainer(config, plan, platform)
    end_startup()
    return trainer


def load_job(config_path: str, overrides: Sequence[str], *, algorithm: str):
    """(config, plan) for the torchrun world size; raises ConfigError before any process
    group exists, so every rank fails alike and at once."""
    from mindspeed_rl.config import load_config, make_plan

    config = load_config(config_path, overrides, algorithm=algorithm)
    return config, make_plan(config, int(os.environ.get("WORLD_SIZE", "1")))


def _start(config, plan, *, header: str, plan_to: TextIO | None):
    """The platform and the process groups; rank 0 prints the plan (its phases and the
    composed rollout included)."""
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import init_distributed
    from mindspeed_rl.platform import setup_platform

    platform = setup_platform()
    init_distributed(platform, timeout_s=config.rl_config.collective_timeout_s,
                     startup_timeout_s=config.rl_config.startup_timeout_s)
    if dist.get_rank() == 0:
        print(plan.format(header=header), file=plan_to or sys.stdout, flush=True)
        from mindspeed_rl.fault.save_time import save_time_line

        line = save_time_line(config, plan)
        if line:
            print(line, file=sys.stderr if line.startswith("warning") else
                  plan_to or sys.stdout, flush=True)
    return platform


@contextlib.contextmanager
def trainer_session(config, plan, *, header: str, plan_to: TextIO | None = None
                    ) -> Iterator["RLTrainer"]:  # noqa: F821
    """Platform, process groups and the trainer for ``config``; torn down on exit (for a
    process that ends next: see ``_release``)."""
    make_non_dumpable()
    platform = _start(config, plan, header=header, plan_to=plan_to)
    trainer = None
    try:
        trainer = _build_trainer(config, plan, platform)
        yield trainer
    finally:
        _release(trainer)


def launch(argv: Sequence[str] | None, *, prog: str, algorithm: str) -> int:
    """Run a launcher: ``--config FILE [key=value ...] [--dry-run --world-size N]``.

    Returns the exit status: 0 (also after a preemption, with a checkpoint), 2 after one
    ``prog: error: ...`` line for bad input (the config, or a dataset row, a tokenizer, a
    checkpoint found while building), 1 after one line for a failure (a lost rank, NaN/Inf,
    a full disk; see mindspeed_rl/trainer/launch_guard.py).
    """
    from mindspeed_rl.metrics.console import quiet_known_noise

    make_non_dumpable()  # first: nothing the run starts may read or write the trainer
    quiet_known_noise()  # before torch, megatron and vLLM are imported
    from mindspeed_rl.config import ConfigError, parse_launcher_args
    from mindspeed_rl.config.cli import main as config_main
    from mindspeed_rl.trainer.launch_guard import LaunchGuard, report_config_error

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_launcher_args(argv, prog=prog)
        if args.dry_run:
            return config_main(argv, prog=prog, algorithm=algorithm)
        config, plan = load_job(args.config, args.overrides, algorithm=algorithm)
    except ConfigError as error:
        return report_config_error(prog, error)  # once, also in torchrun's error file
    platform = _start(config, plan, header=f"{prog}: {args.config} on {plan.world_size} ranks "
                                           "(memory figures are estimates)", plan_to=None)
    guard = LaunchGuard(prog, config)  # phases, heartbeat, SIGTERM
    trainer = None
    try:
        trainer = _build_trainer(config, plan, platform)
        guard.training_starts(trainer.state.iteration)  # SIGTERM -> save at a boundary
        trainer.train()
    except BaseException as error:  # one line + exit status; may end the process
        return guard.failed(error, trainer.save_checkpoint if trainer is not None else None)
    finally:
        guard.teardown(lambda: _release(trainer))  # (after a preemption too)
    return 0
