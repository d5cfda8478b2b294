"""What defines an algorithm family and an advantage estimator: plain declarations that
the registry (``registry.py``) collects and the config, the dry run and the trainer read.

An **algorithm family** is what one launcher runs (GRPO: ``pretrain_grpo.py``; PPO:
``pretrain_ppo.py``): its phases in order, the roles it builds, the MindSpeed-RL
``stage`` names it answers to and the estimator it runs when ``rl_config.adv_estimator``
is left out. An **estimator** is one choice of ``rl_config.adv_estimator`` within the
families that list it: the phase that computes it (one of the family's advantage
phases), the roles it needs, its smallest group, and its pure tensor function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Roles a family can build besides the actor (the reference and the reward model are
# built when the config asks for them, in every family).
CRITIC = "critic"


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator (docs/algorithms.md lists them with their formulas).

    ``fn`` is called by the estimator's phase: an ``adv``-phase estimator gets the
    sequence rewards of whole groups, ``fn(scores [groups, n], **params) -> [groups, n]``;
    a ``discounted_returns``-phase estimator gets per-token rewards,
    ``fn(rewards [batch, R], mask [batch, R], **params) -> returns [batch, R]``. ``params``
    names the ``rl_config`` keys passed as keyword arguments. GAE's phase is its own.
    """

    name: str                          # the value of rl_config.adv_estimator
    algorithms: tuple[str, ...]        # the families (launchers) that run it
    phase: str                         # the phase that computes it (phase_names.py)
    formula: str                       # one line, for errors and docs
    source: str                        # where the formula comes from
    fn: Callable | None = None
    params: tuple[str, ...] = ()       # rl_config keys passed to fn by name
    aliases: tuple[str, ...] = ()      # verl's names that mean the same estimator
    needs: frozenset[str] = frozenset()  # roles it reads (CRITIC)
    min_group_size: int = 1            # smallest rl_config.n_samples_per_prompt
    whiten_batch: bool = False         # advantages whitened over the whole batch's tokens
    kl_in_reward: bool = False         # may take the KL to the reference into its reward


@dataclass(frozen=True)
class Algorithm:
    """One algorithm family: what its launcher runs."""

    name: str                          # "grpo": RLJobConfig.algorithm, --algorithm
    launcher: str                      # "pretrain_grpo.py"
    stages: tuple[str, ...]            # MindSpeed-RL's megatron_training.stage names
    phases: tuple[str, ...]            # every phase it may run, in order
    default_estimator: str             # rl_config.adv_estimator when left out
    builds: frozenset[str] = frozenset()  # roles it builds (CRITIC)
    # rl_config features whose rows the family's phases are built for
    features: frozenset[str] = frozenset()
