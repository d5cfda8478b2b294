"""The GRPO family (``pretrain_grpo.py``; MindSpeed-RL's ``ray_grpo`` and ``ray_dapo``)
and its own estimator, ``group_norm``.

GRPO trains no critic: the baseline of each response comes from the other responses of
its prompt (the group), or from the batch. Its advantage estimators are registered in
``registry.py``; ``group_norm`` is the one it runs when ``rl_config.adv_estimator`` is
left out. DAPO is GRPO with dynamic sampling, clip-higher and token-level loss.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.advantages import group_normalized_advantages
from mindspeed_rl.algorithms.family import Algorithm, Estimator

GRPO = Algorithm(
    name="grpo", launcher="pretrain_grpo.py", stages=("ray_grpo", "ray_dapo"),
    phases=(p.RESHARDING_TO_INFER, p.ROLLOUT, p.RESHARDING_TO_TRAIN, p.REWARD_MODEL, p.REWARD,
            p.DYNAMIC_SAMPLING, p.ADV, p.OLD_LOG_P, p.REFERENCE_MODEL, p.DISCOUNTED_RETURNS,
            p.TEACHER_MODEL, p.DISTILL_ADV, p.UPDATE),
    default_estimator="group_norm",
    features=frozenset({"dynamic_sampling", "partial_rollout", "multi_turn"}),
)


def group_norm(scores: torch.Tensor, norm_adv_by_std_in_grpo: bool = True) -> torch.Tensor:
    """[groups, n] sequence rewards -> [groups, n] GRPO advantages
    (``group_normalized_advantages``)."""
    return group_normalized_advantages(scores, scores.shape[1],
                                       norm_by_std=norm_adv_by_std_in_grpo)


GROUP_NORM = Estimator(
    name="group_norm", algorithms=("grpo",), phase=p.ADV, fn=group_norm,
    params=("norm_adv_by_std_in_grpo",), aliases=("grpo",), min_group_size=2,
    formula="A_i = (r_i - mean_g) / (std_g + 1e-6), std unbiased (without the division when "
            "norm_adv_by_std_in_grpo is false)",
    source="MindSpeed-RL compute_group_norm_advantage_return; verl "
           "compute_grpo_outcome_advantage (adv_estimator: grpo)",
)
