"""The GRPO family (``pretrain_grpo.py``; MindSpeed-RL's ``ray_grpo`` and ``ray_dapo``)
and its own estimator, ``group_norm``.

GRPO trains no critic: the baseline of each response comes from the other responses of
its prompt (the group), or from the batch. ``group_norm`` is the estimator it runs when
``rl_config.adv_estimator`` is left out; the others register themselves in their own
modules. DAPO is GRPO with dynamic sampling, clip-higher and token-level loss.
"""

from __future__ import annotations

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.advantages import group_normalized_advantages
from mindspeed_rl.algorithms.estimator import AdvantageInputs, AdvantageOutputs, Sums
from mindspeed_rl.algorithms.family import Algorithm
from mindspeed_rl.algorithms.registry import register, register_estimator

GRPO = register(Algorithm(
    name="grpo", launcher="pretrain_grpo.py", stages=("ray_grpo", "ray_dapo"),
    phases=(p.RESHARDING_TO_INFER, p.ROLLOUT, p.RESHARDING_TO_TRAIN, p.REWARD_MODEL, p.REWARD,
            p.DYNAMIC_SAMPLING, p.ADV, p.OLD_LOG_P, p.REFERENCE_MODEL, p.DISCOUNTED_RETURNS,
            p.TEACHER_MODEL, p.DISTILL_ADV, p.UPDATE),
    default_estimator="group_norm",
    supports=frozenset({"dynamic_sampling", "partial_rollout", "multi_turn"}),
))


@register_estimator(
    "group_norm", algorithms=("grpo",), phase=p.ADV, params=("norm_adv_by_std_in_grpo",),
    aliases=("grpo",), min_group_size=2,
    formula="A_i = (r_i - mean_g) / (std_g + 1e-6), std unbiased (without the division when "
            "norm_adv_by_std_in_grpo is false)",
    source="MindSpeed-RL compute_group_norm_advantage_return; verl "
           "compute_grpo_outcome_advantage (adv_estimator: grpo)")
def group_norm(x: AdvantageInputs, sums: Sums,
               norm_adv_by_std_in_grpo: bool = True) -> AdvantageOutputs:
    """Each response's reward against its group's mean (and std): one advantage per
    response, on each of its tokens (``group_normalized_advantages``)."""
    scores = x.grouped(x.rewards)  # [groups, n]
    return AdvantageOutputs.per_sequence(
        group_normalized_advantages(scores, x.group_size, norm_by_std=norm_adv_by_std_in_grpo), x)
