"""What defines an algorithm family: a plain declaration that the registry
(``registry.py``) collects and the config, the dry run and the trainer read.

An **algorithm family** is what one launcher runs (GRPO: ``pretrain_grpo.py``; PPO:
``pretrain_ppo.py``): its phases in order, the roles it builds, the MindSpeed-RL
``stage`` names it answers to, the estimator it runs when ``rl_config.adv_estimator`` is
left out (none for a family without advantages, such as DPO), the features every job of
it has, and the optional features its phases are built for. Its estimators
(``estimator.py``) name the families that run them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Roles a family can build besides the actor (the reference and the reward model are
# built when the config asks for them, in every family).
CRITIC = "critic"


@dataclass(frozen=True)
class Algorithm:
    """One algorithm family: what its launcher runs."""

    name: str                          # "grpo": RLJobConfig.algorithm, --algorithm
    launcher: str                      # "pretrain_grpo.py"
    stages: tuple[str, ...]            # MindSpeed-RL's megatron_training.stage names
    phases: tuple[str, ...]            # every phase it may run, in order
    default_estimator: str | None      # rl_config.adv_estimator when left out (None: it
    #                                    computes no advantages, e.g. DPO)
    builds: frozenset[str] = frozenset()  # roles it builds (CRITIC)
    # features (config/features.py) every job of the family has, whatever its config
    # (DPO: the reference)
    always: frozenset[str] = frozenset()
    # the optional features (config/features.py) whose rows and phases it is built for
    supports: frozenset[str] = frozenset()
