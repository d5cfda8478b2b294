"""The phase table: each phase name (``mindspeed_rl/algorithms/phase_names.py``) with its
function and whether it belongs to the generation round. Which phases a job runs, and in
what order, is decided in the config layer (``config.features.phases``: its family's
phase list with its estimator's advantage phase, less the optional phases no feature
asks for, ``mindspeed_rl/config/features.py``).

    GRPO: [reshard -> rollout -> reshard -> [reward model] -> reward -> [dynamic sampling]]
          -> [adv] -> [old log-probs] -> [reference] -> [discounted returns]
          -> [teacher -> distill adv] -> actor update
    PPO:  [reshard -> rollout -> reshard -> [reward model] -> reward] -> values
          -> [old log-probs] -> [reference] -> GAE -> critic update -> actor update
    DPO:  [pairs] -> reference -> preference update

The outer brackets are the generation round: the trainer repeats those phases until the
batch is ready (a round-closing phase such as DAPO's dynamic sampling may ask for
another round on fresh prompts), then runs the rest once. Phases in inner brackets run
only when the job needs them; of the advantage phases the estimator's runs (all four map
to one function: the estimator owns its math).

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
                                                 PAIRS, PREFERENCE_UPDATE,
                                                 REFERENCE_MODEL, RESHARDING_TO_INFER,
                                                 RESHARDING_TO_TRAIN, REWARD, REWARD_MODEL,
                                                 ROLLOUT, TEACHER_MODEL, UPDATE, VALUES)
from mindspeed_rl.trainer import phases as p
from mindspeed_rl.trainer import preference


@dataclass(frozen=True)
class Phase:
    name: str  # also its timer (timing/<name>) and its TransferDock consumer name
    run: Callable  # run(ctx: PhaseContext) -> metrics
    generation: bool = False  # part of the generation round (repeated until the batch is ready)


# One line per phase: its function and whether it belongs to the generation round. The
# order phases run in is each family's (mindspeed_rl/algorithms/).
PHASES: dict[str, Phase] = {phase.name: phase for phase in (
    Phase(PAIRS, preference.pairs, generation=True),
    Phase(RESHARDING_TO_INFER, p.resharding_to_infer, generation=True),
    Phase(ROLLOUT, p.rollout, generation=True),
    Phase(RESHARDING_TO_TRAIN, p.resharding_to_train, generation=True),
    Phase(REWARD_MODEL, p.reward_model, generation=True),
    Phase(REWARD, p.reward, generation=True),
    Phase(DYNAMIC_SAMPLING, p.dynamic_sampling, generation=True),
    Phase(ADV, p.advantages),
    Phase(VALUES, p.values),
    Phase(OLD_LOG_P, p.old_logprobs),
    Phase(REFERENCE_MODEL, p.reference_logprobs),
    Phase(DISCOUNTED_RETURNS, p.advantages),
    Phase(TEACHER_MODEL, p.teacher_logprobs),
    Phase(DISTILL_ADV, p.advantages),
    Phase(GAE, p.advantages),
    Phase(CRITIC_UPDATE, p.critic_update),
    Phase(UPDATE, p.actor_update),
    Phase(PREFERENCE_UPDATE, preference.preference_update),
)}


def recipes() -> dict[str, tuple[str, ...]]:
    """Every registered (family, estimator) pair's phase names, keyed ``family/estimator``,
    and each family without advantages under its name (what the column contract is
    checked against)."""
    return {**{f"{a.name}/{e.name}": registry.phases(a.name, e.name)
               for a in registry.algorithms() for e in registry.estimators(a.name)},
            **{a.name: registry.phases(a.name, None) for a in registry.algorithms()
               if a.default_estimator is None}}


def phases_of(config) -> tuple[Phase, ...]:
    """The phases ``config``'s job runs, in order (``config.features.phases``)."""
    return tuple(PHASES[name] for name in config.features.phases)


def split_rounds(phases: tuple[Phase, ...]) -> tuple[tuple[Phase, ...], tuple[Phase, ...]]:
    """(the generation round's phases, the phases that run once after it)."""
    count = 0
    while count < len(phases) and phases[count].generation:
        count += 1
    if any(phase.generation for phase in phases[count:]):
        raise ValueError("the generation-round phases must come first in an algorithm")
    return phases[:count], phases[count:]
