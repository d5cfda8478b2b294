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

    from mindspeed_rl.metrics.console import quiet_known_noise  # [issue 13] console noise

    quiet_known_noise()  # [issue 13] before torch, megatron and vLLM are imported
    from mindspeed_rl.fault.launch_guard import LaunchGuard, report_config_error  # [issue 13]

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_launcher_args(argv, prog="pretrain_grpo.py")
        if args.dry_run:
            return config_main(argv, prog="pretrain_grpo.py")
        config = load_config(args.config, args.overrides)
        plan = make_plan(config, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        return report_config_error("pretrain_grpo.py", error)  # [issue 13] once, torchrun file

    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import init_distributed, teardown_distributed
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.trainer import GRPOTrainer

    platform = setup_platform()
    init_distributed(platform, timeout_s=config.rl_config.collective_timeout_s)  # [issue 13]
    guard = LaunchGuard("pretrain_grpo.py", config)  # [issue 13] phases, heartbeat
    trainer = None
    try:
        if dist.get_rank() == 0:
            print(plan.format(header=f"pretrain_grpo.py: {args.config} on {plan.world_size} "
                                     "ranks (memory figures are estimates)"), flush=True)
        trainer = GRPOTrainer(config, platform, plan.layout)
        guard.training_starts(trainer.iteration)  # [issue 13] SIGTERM -> save at a boundary
        trainer.train()
    except BaseException as error:  # [issue 13] one line + exit status; may end the process
        return guard.failed(error, trainer._save_checkpoint if trainer is not None else None)
    finally:
        guard.teardown(lambda: teardown_distributed(  # [issue 13] (after a preemption too)
            trainer.close if trainer is not None else None))
    return 0


if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    sys.exit(main())
