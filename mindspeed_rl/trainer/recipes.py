"""The phase table: each phase name (``mindspeed_rl/algorithms/phase_names.py``) with its
function and when it runs; an algorithm's recipe is its family's phase list with its
estimator's advantage phase (``mindspeed_rl/algorithms/registry.py``).

    GRPO: [reshard -> rollout -> reshard -> [reward model] -> reward -> [dynamic sampling]]
          -> [adv] -> [old log-probs] -> [reference] -> [discounted returns]
          -> [teacher -> distill adv] -> actor update
    PPO:  [reshard -> rollout -> reshard -> [reward model] -> reward] -> values
          -> [old log-probs] -> [reference] -> GAE -> critic update -> actor update

The outer brackets are the generation round: the trainer repeats those phases until the
batch is ready (a round-closing phase such as DAPO's dynamic sampling may ask for
another round on fresh prompts), then runs the rest once. Phases in inner brackets
run only when the job needs them (a reward model is configured, dynamic sampling, more
than one optimizer step per iteration, a KL term); of GRPO's two advantage phases the
estimator's runs (``adv``: group_norm, rloo, reinforce_plus_plus_baseline;
``discounted_returns``: reinforce_plus_plus, after the forwards whose KL it may read).

A new phase is one function ``phase(ctx) -> metrics`` (``phases.py``), one line in
``PHASES`` below, and its name in the phase list of each family that runs it
(docs/trainer.md has a worked example).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms.phase_names import (ADV, CRITIC_UPDATE, DISCOUNTED_RETURNS,
                                                 DISTILL_ADV, DYNAMIC_SAMPLING, GAE, OLD_LOG_P,
                                                 REFERENCE_MODEL, RESHARDING_TO_INFER,
                                                 RESHARDING_TO_TRAIN, REWARD, REWARD_MODEL,
                                                 ROLLOUT, TEACHER_MODEL, UPDATE, VALUES)
from mindspeed_rl.trainer import distillation_phases as d
from mindspeed_rl.trainer import phases as p


@dataclass(frozen=True)
class Phase:
    name: str  # also its timer (timing/<name>) and its TransferDock consumer name
    run: Callable  # run(ctx: PhaseContext) -> metrics
    generation: bool = False  # part of the generation round (repeated until the batch is ready)
    needed: Callable = lambda config, plan: True  # needed(config, plan) -> bool


def _old_logprobs_needed(config, plan) -> bool:
    """After the first optimizer step of an iteration the policy is no longer the one the
    iteration started with (the proximal policy of a partial rollout's older rows); the
    KL-in-reward (PPO, REINFORCE++) also reads those log-probs, and so does the batch mean
    of the rollout-correction weights (``rollout_is_batch_normalize``). With one optimizer step the
    update's own forward runs at the proximal weights: its log-probs, detached, are the
    old ones."""
    rl = config.rl_config
    return (plan.batch.needs_old_logprobs or (rl.use_kl_in_reward and rl.init_kl_coef != 0)
            or config.teacher_config is not None  # distillation: the student's log-probs
            or (rl.rollout_is is not None and rl.rollout_is_batch_normalize)  # the batch's mean
            or rl.router_replay == "R2")  # routing replay R2 records this pass's experts


# One line per phase: its function, whether it belongs to the generation round, and when
# a job needs it. The order phases run in is each family's (mindspeed_rl/algorithms/).
PHASES: dict[str, Phase] = {phase.name: phase for phase in (
    Phase(RESHARDING_TO_INFER, p.resharding_to_infer, generation=True),
    Phase(ROLLOUT, p.rollout, generation=True),
    Phase(RESHARDING_TO_TRAIN, p.resharding_to_train, generation=True),
    Phase(REWARD_MODEL, p.reward_model, generation=True,
          needed=lambda config, plan: config.reward_config is not None),
    Phase(REWARD, p.reward, generation=True),
    Phase(DYNAMIC_SAMPLING, p.dynamic_sampling, generation=True,
          needed=lambda config, plan: config.rl_config.filter_groups_enable),
    Phase(ADV, p.group_advantages),
    Phase(VALUES, p.values),
    Phase(OLD_LOG_P, p.old_logprobs, needed=_old_logprobs_needed),
    Phase(REFERENCE_MODEL, p.reference_logprobs,
          needed=lambda config, plan: config.rl_config.init_kl_coef != 0),
    Phase(DISCOUNTED_RETURNS, p.discounted_returns),
    Phase(TEACHER_MODEL, d.teacher_logprobs,
          needed=lambda config, plan: config.teacher_config is not None),
    Phase(DISTILL_ADV, d.distill_advantages),
    Phase(GAE, p.gae),
    Phase(CRITIC_UPDATE, p.critic_update),
    Phase(UPDATE, p.actor_update),
)}


def recipes() -> dict[str, tuple[str, ...]]:
    """Every registered (family, estimator) pair's phase names, keyed ``family/estimator``
    (what the column contract is checked against)."""
    return {f"{a.name}/{e.name}": registry.phases(a.name, e.name)
            for a in registry.algorithms() for e in registry.estimators(a.name)}


# Each family's default recipe under its name ("grpo", "ppo"), and every (family,
# estimator) recipe as "family/estimator" (the registry when this module was imported).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    **{a.name: registry.phases(a.name, a.default_estimator) for a in registry.algorithms()},
    **recipes()}


def phases_of(config, plan) -> tuple[Phase, ...]:
    """The phases ``config``'s algorithm runs with its estimator, in order (those it does
    not need left out)."""
    names = registry.phases(config.algorithm, config.rl_config.adv_estimator)
    return tuple(PHASES[name] for name in names if PHASES[name].needed(config, plan))


def split_rounds(phases: tuple[Phase, ...]) -> tuple[tuple[Phase, ...], tuple[Phase, ...]]:
    """(the generation round's phases, the phases that run once after it)."""
    count = 0
    while count < len(phases) and phases[count].generation:
        count += 1
    if any(phase.generation for phase in phases[count:]):
        raise ValueError("the generation-round phases must come first in an algorithm")
    return phases[:count], phases[count:]
