"""Command-line front of the config: ``--config FILE [key=value ...] [--dry-run --world-size N]``.

Launchers (``pretrain_grpo.py``) and ``python -m mindspeed_rl.config`` share
this parser, so every entry point accepts the same overrides and the same
dry-run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Sequence

import yaml

from mindspeed_rl.algorithms import registry
from mindspeed_rl.config.config_error import ConfigError
from mindspeed_rl.config.loader import load_config
from mindspeed_rl.config.plan import make_plan

_EPILOG = """\
overrides: dotted.key=value, value parsed as YAML, e.g.
  rl_config.n_samples_per_prompt=8  actor_config.lr=1e-6  megatron_training.bf16=true
  rl_config.verifier_function=[math_answer,format]
relative paths in the config resolve against the current working directory.
python -m mindspeed_rl.config also takes --algorithm grpo|ppo (the launcher the config is for).
exit status: 0 ok, 2 invalid arguments or config (one line on stderr)."""


@dataclass(frozen=True)
class LauncherArgs:
    """Parsed launcher command line."""

    config: str                    # the YAML file
    overrides: tuple[str, ...]     # "dotted.key=value" strings, in order (later ones win)
    dry_run: bool
    world_size: int | None         # for --dry-run; launchers otherwise use torchrun's WORLD_SIZE


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting,
    so launchers report every kind of bad input the same way."""

    def error(self, message: str):
        raise ConfigError(None, message, f"see {self.prog} --help")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = _RaisingParser(prog=prog, description="mindspeed_rl job configuration",
                            epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job YAML, e.g. configs/grpo_qwen25_7b.yaml")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate for --world-size ranks and print the plan; starts nothing "
                             "and needs neither data nor weights")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks to plan for (with --dry-run)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. rl_config.n_samples_per_prompt=8")
    return parser


def parse_launcher_args(argv: Sequence[str], prog: str | None = None) -> LauncherArgs:
    """Parse ``--config FILE [dotted.key=value ...] [--dry-run --world-size N]``.

    Overrides may appear before or after the options. Raises `ConfigError` on
    bad arguments (``--help`` still prints and exits 0).
    """
    args = build_parser(prog).parse_intermixed_args(list(argv))
    if args.dry_run and args.world_size is None:
        raise ConfigError("--dry-run", "needs --world-size N", "add e.g. --world-size 16")
    if args.world_size is not None and args.world_size < 1:
        raise ConfigError("--world-size", "must be a positive number of ranks", "e.g. 16",
                          value=args.world_size)
    for text in args.overrides:
        if "=" not in text:
            raise ConfigError(None, f"argument {text!r} is not a dotted.key=value override",
                              "write e.g. rl_config.n_samples_per_prompt=8")
    return LauncherArgs(config=args.config, overrides=tuple(args.overrides),
                        dry_run=args.dry_run, world_size=args.world_size)


def main(argv: Sequence[str] | None = None, prog: str = "python -m mindspeed_rl.config",
         algorithm: str | None = None) -> int:
    """Validate a config; with ``--dry-run`` print the plan, otherwise the effective config.

    ``algorithm`` is the launcher's (None: the ``--algorithm`` option, default grpo).
    Returns the exit status: 0, or 2 with one ``error: ...`` line on stderr.
    """
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if algorithm is None:
            algorithm, argv = _split_algorithm(argv)
        args = parse_launcher_args(argv, prog=prog)
        config = load_config(args.config, args.overrides, check_data=not args.dry_run,
                             algorithm=algorithm)
        if args.dry_run:
            plan = make_plan(config, args.world_size)
            print(plan.format())
            print(estimator_line(config))
            from mindspeed_rl.fault.save_time import save_time_line

            line = save_time_line(config, plan)  # measures the save folder
            if line:
                print(line)
        else:
            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def estimator_line(config) -> str:
    """The dry run's line naming the advantage estimator the job runs and its formula (DPO:
    its loss)."""
    estimator = registry.estimator(config.rl_config.adv_estimator)
    launcher = registry.algorithm(config.algorithm).launcher
    if estimator is None:
        mt = config.megatron_training
        return (f"loss: DPO {mt.dpo_loss_type} ({launcher}), beta {mt.dpo_beta:g}, label "
                f"smoothing {mt.dpo_label_smoothing:g}, pref_ftx {mt.pref_ftx:g}")
    return f"advantages: {estimator.name} ({launcher}): {estimator.formula}"


def _split_algorithm(argv: list[str]) -> tuple[str, list[str]]:
    """``--algorithm X`` (or ``--algorithm=X``) out of ``argv``: (X or "grpo", the rest)."""
    rest, algorithm, i = [], "grpo", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--algorithm" and i + 1 < len(argv):
            algorithm, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--algorithm="):
            algorithm = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    names = [a.name for a in registry.algorithms()]
    if algorithm not in names:
        raise ConfigError("--algorithm", f"must be {' or '.join(names)}",
                          f"e.g. --algorithm {names[-1]}", value=algorithm)
    return algorithm, rest
