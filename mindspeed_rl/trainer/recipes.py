"""Algorithms as ordered lists of phases over one column contract.

    GRPO: [reshard -> rollout -> reshard -> [reward model] -> reward -> [dynamic sampling]]
          -> group advantages -> [old log-probs] -> [reference] -> actor update
    PPO:  [reshard -> rollout -> reshard -> [reward model] -> reward] -> values
          -> [old log-probs] -> [reference] -> GAE -> critic update -> actor update

The outer brackets are the generation round: the trainer repeats those phases until the
batch is ready (a round-closing phase such as DAPO's dynamic sampling may ask for
another round on fresh prompts), then runs the rest once. Phases in inner brackets
run only when the job needs them (a reward model is configured, dynamic sampling, more
than one optimizer step per iteration, a KL term).

A new phase is one function ``phase(ctx) -> metrics`` (``phases.py``) and one line in
``PHASES`` below, where its position is its place in every algorithm that runs it
(docs/trainer.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_rl.config.phase_names import (ADV, CRITIC_UPDATE, DYNAMIC_SAMPLING, GAE,
                                             OLD_LOG_P, REFERENCE_MODEL, RESHARDING_TO_INFER,
                                             RESHARDING_TO_TRAIN, REWARD, REWARD_MODEL, ROLLOUT,
                                             UPDATE, VALUES)
from mindspeed_rl.trainer import phases as p


@dataclass(frozen=True)
class Phase:
    name: str  # also its timer (timing/<name>) and its TransferDock consumer name
    run: Callable  # run(ctx: PhaseContext) -> metrics
    algorithms: tuple[str, ...]  # the algorithms that run it
    generation: bool = False  # part of the generation round (repeated until the batch is ready)
    needed: Callable = lambda config, plan: True  # needed(config, plan) -> bool


def _old_logprobs_needed(config, plan) -> bool:
    """After the first optimizer step of an iteration the policy is no longer the one the
    iteration started with (the proximal policy of a partial rollout's older rows); PPO's
    KL-in-reward also reads those log-probs. With one optimizer step the update's own
    forward runs at the proximal weights: its log-probs, detached, are the old ones."""
    rl = config.rl_config
    return plan.batch.needs_old_logprobs or (rl.use_kl_in_reward and rl.init_kl_coef != 0)


_GRPO, _PPO = ("grpo",), ("ppo",)
_BOTH = _GRPO + _PPO

# One line per phase, in the order phases run; ``algorithms`` says which algorithms run it.
PHASES: dict[str, Phase] = {phase.name: phase for phase in (
    Phase(RESHARDING_TO_INFER, p.resharding_to_infer, _BOTH, generation=True),
    Phase(ROLLOUT, p.rollout, _BOTH, generation=True),
    Phase(RESHARDING_TO_TRAIN, p.resharding_to_train, _BOTH, generation=True),
    Phase(REWARD_MODEL, p.reward_model, _BOTH, generation=True,
          needed=lambda config, plan: config.reward_config is not None),
    Phase(REWARD, p.reward, _BOTH, generation=True),
    Phase(DYNAMIC_SAMPLING, p.dynamic_sampling, _GRPO, generation=True,
          needed=lambda config, plan: config.rl_config.filter_groups_enable),
    Phase(ADV, p.group_advantages, _GRPO),
    Phase(VALUES, p.values, _PPO),
    Phase(OLD_LOG_P, p.old_logprobs, _BOTH, needed=_old_logprobs_needed),
    Phase(REFERENCE_MODEL, p.reference_logprobs, _BOTH,
          needed=lambda config, plan: config.rl_config.init_kl_coef != 0),
    Phase(GAE, p.gae, _PPO),
    Phase(CRITIC_UPDATE, p.critic_update, _PPO),
    Phase(UPDATE, p.actor_update, _BOTH),
)}


def algorithms_of(phases: dict[str, Phase]) -> dict[str, tuple[str, ...]]:
    """Each algorithm's phase names, in the order of ``phases``."""
    names = sorted({a for phase in phases.values() for a in phase.algorithms})
    return {a: tuple(n for n, phase in phases.items() if a in phase.algorithms) for a in names}


ALGORITHMS: dict[str, tuple[str, ...]] = algorithms_of(PHASES)


def phases_of(config, plan) -> tuple[Phase, ...]:
    """The phases ``config``'s algorithm runs, in order (those it does not need left out)."""
    return tuple(PHASES[name] for name in ALGORITHMS[config.algorithm]
                 if PHASES[name].needed(config, plan))


def split_rounds(phases: tuple[Phase, ...]) -> tuple[tuple[Phase, ...], tuple[Phase, ...]]:
    """(the generation round's phases, the phases that run once after it)."""
    count = 0
    while count < len(phases) and phases[count].generation:
        count += 1
    if any(phase.generation for phase in phases[count:]):
        raise ValueError("the generation-round phases must come first in an algorithm")
    return phases[:count], phases[count:]
