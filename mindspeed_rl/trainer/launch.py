"""The one bootstrap of every launcher (pretrain_grpo.py, pretrain_ppo.py) and of
benchmarks/bench_grpo.py: config and plan before any process group, then platform,
process groups, the trainer, and the teardown in ``finally``."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Sequence, TextIO


def load_job(config_path: str, overrides: Sequence[str], *, algorithm: str):
    """(config, plan) for the torchrun world size; raises ConfigError before any process
    group exists, so every rank fails alike and at once."""
    from mindspeed_rl.config import load_config, make_plan

    config = load_config(config_path, overrides, algorithm=algorithm)
    return config, make_plan(config, int(os.environ.get("WORLD_SIZE", "1")))


@contextlib.contextmanager
def trainer_session(config, plan, *, header: str, plan_to: TextIO | None = None
                    ) -> Iterator["RLTrainer"]:  # noqa: F821
    """Platform, process groups and the trainer for ``config``; torn down on exit."""
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import init_distributed, teardown_distributed
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.trainer.recipes import phases_of
    from mindspeed_rl.trainer.trainer import RLTrainer

    platform = setup_platform()
    init_distributed(platform, timeout_s=max(1800, config.rl_config.transfer_dock_timeout_s))
    trainer = None
    try:
        if dist.get_rank() == 0:
            print(plan.format(header=header), file=plan_to or sys.stdout, flush=True)
            print(f"phases: {' -> '.join(p.name for p in phases_of(config, plan))}",
                  file=plan_to or sys.stdout, flush=True)
        trainer = RLTrainer(config, plan, platform)
        if dist.get_rank() == 0 and config.rl_config.use_remove_padding:  # issue 14
            from mindspeed_rl.trainer.packing import packing_notice

            print(packing_notice(trainer.roles.actor.model), file=plan_to or sys.stdout,
                  flush=True)
        yield trainer
    finally:
        teardown_distributed(trainer.close if trainer is not None else None)


def launch(argv: Sequence[str] | None, *, prog: str, algorithm: str) -> int:
    """Run a launcher: ``--config FILE [key=value ...] [--dry-run --world-size N]``.

    Returns the exit status: 0, or 2 after one ``prog: error: ...`` line (bad config,
    or bad input found while building: a dataset row, a tokenizer, a checkpoint).
    """
    from mindspeed_rl.config import ConfigError, parse_launcher_args
    from mindspeed_rl.config.cli import main as config_main

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_launcher_args(argv, prog=prog)
        if args.dry_run:
            return config_main(argv, prog=prog, algorithm=algorithm)
        config, plan = load_job(args.config, args.overrides, algorithm=algorithm)
    except ConfigError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        with trainer_session(config, plan, header=f"{prog}: {args.config} on {plan.world_size} "
                                                  "ranks (memory figures are estimates)"
                             ) as trainer:
            trainer.train()
    except (ValueError, FileNotFoundError) as error:
        # Every rank reads the same files and fails alike: report once.
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        if os.environ.get("MINDSPEED_RL_DEBUG"):
            raise
        return 2
    return 0
