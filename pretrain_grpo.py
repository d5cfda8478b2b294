#!/usr/bin/env python
"""GRPO launcher (one SPMD program; run it under torchrun).

  torchrun --nproc_per_node 2 pretrain_grpo.py --config configs/grpo_smollm2_demo.yaml \\
      [rl_config.n_samples_per_prompt=8 ...]
  python pretrain_grpo.py --config configs/grpo_qwen25_7b.yaml --dry-run --world-size 16

The config is validated for the launched world size before any process group exists.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from mindspeed_rl.config import ConfigError, load_config, make_plan, parse_launcher_args
    from mindspeed_rl.config.cli import main as config_main

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_launcher_args(argv, prog="pretrain_grpo.py")
        if args.dry_run:
            return config_main(argv, prog="pretrain_grpo.py")
        config = load_config(args.config, args.overrides)
        plan = make_plan(config, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        print(f"pretrain_grpo.py: error: {error}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from mindspeed_rl.checkpoint.errors import CheckpointError
    from mindspeed_rl.parallel.groups import init_distributed, teardown_distributed
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.trainer import GRPOTrainer

    platform = setup_platform()
    init_distributed(platform, timeout_s=max(1800, config.rl_config.transfer_dock_timeout_s))
    trainer = None
    try:
        if dist.get_rank() == 0:
            print(plan.format(header=f"pretrain_grpo.py: {args.config} on {plan.world_size} "
                                     "ranks (memory figures are estimates)"), flush=True)
        trainer = GRPOTrainer(config, platform, plan.layout)
        trainer.train()
    except (ValueError, FileNotFoundError, CheckpointError) as error:  # [issue15 hook] + CheckpointError
        # Bad input found while building (a dataset row, a tokenizer, a checkpoint): every
        # rank reads the same files and fails alike, so report once and exit.
        if dist.get_rank() == 0:
            print(f"pretrain_grpo.py: error: {error}", file=sys.stderr, flush=True)
        if os.environ.get("MINDSPEED_RL_DEBUG"):
            raise
        return 2
    finally:
        teardown_distributed(trainer.close if trainer is not None else None)
    return 0


if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    sys.exit(main())
