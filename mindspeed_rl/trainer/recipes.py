"""Algorithms as ordered lists of phases over one column contract.

    GRPO: reshard -> rollout -> reshard -> [reward model] -> reward -> [dynamic sampling]
          -> group advantages -> [old log-probs] -> [reference] -> actor update
    PPO:  reshard -> rollout -> reshard -> [reward model] -> reward -> values
          -> [old log-probs] -> [reference] -> GAE -> critic update -> actor update

Phases in brackets run only when the job needs them (a reward model is
configured, DAPO's dynamic sampling, more than one optimizer step per iteration, a
KL term). Dynamic sampling repeats the phases before it on fresh prompts until the
batch holds enough informative groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mindspeed_rl.trainer import phases as p


@dataclass(frozen=True)
class Phase:
    name: str  # also its timer (timing/<name>) and its TransferDock consumer name
    run: Callable  # run(trainer) -> metrics
    needed: Callable = lambda config, plan: True  # needed(config, plan) -> bool


def _old_logprobs_needed(config, plan) -> bool:
    """After the first optimizer step of an iteration the policy no longer generated the
    rows; PPO's KL-in-reward also reads the rollout policy's log-probs."""
    rl = config.rl_config
    return plan.batch.needs_old_logprobs or (rl.use_kl_in_reward and rl.init_kl_coef != 0)


PHASES: dict[str, Phase] = {phase.name: phase for phase in (
    Phase("resharding_to_infer", p.resharding_to_infer),
    Phase("rollout", p.rollout),
    Phase("resharding_to_train", p.resharding_to_train),
    Phase("reward_model", p.reward_model, lambda config, plan: config.reward_config is not None),
    Phase("reward", p.reward),
    Phase("dynamic_sampling", p.dynamic_sampling,
          lambda config, plan: config.rl_config.filter_groups_enable),
    Phase("adv", p.group_advantages),
    Phase("values", p.values),
    Phase("old_log_p", p.old_logprobs, _old_logprobs_needed),
    Phase("reference_model", p.reference_logprobs,
          lambda config, plan: config.rl_config.init_kl_coef != 0),
    Phase("gae", p.gae),
    Phase("critic_update", p.critic_update),
    Phase("update", p.actor_update),
)}

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "grpo": ("resharding_to_infer", "rollout", "resharding_to_train", "reward_model", "reward",
             "dynamic_sampling", "adv", "old_log_p", "reference_model", "update"),
    "ppo": ("resharding_to_infer", "rollout", "resharding_to_train", "reward_model", "reward",
            "values", "old_log_p", "reference_model", "gae", "critic_update", "update"),
}


def phases_of(config, plan) -> tuple[Phase, ...]:
    """The phases ``config``'s algorithm runs, in order (those it does not need left out)."""
    return tuple(PHASES[name] for name in ALGORITHMS[config.algorithm]
                 if PHASES[name].needed(config, plan))
