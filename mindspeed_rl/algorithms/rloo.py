"""RLOO, REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024,
arXiv 2402.14740): each response is measured against the mean reward of the *other*
responses of its prompt, an unbiased baseline that needs no critic.

    A_i = r_i - (1 / (n - 1)) sum_{j != i} r_j  =  n / (n - 1) * (r_i - mean_g)

The same definition as verl's ``compute_rloo_outcome_advantage`` (which also leaves a
group of one unchanged, A = r; the config here refuses n_samples_per_prompt = 1 for it,
since there is no other sample to compare with). No std division, no whitening.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.estimator import AdvantageInputs, AdvantageOutputs, Sums
from mindspeed_rl.algorithms.registry import register_estimator


def rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """[groups, n] sequence rewards (the n samples of one prompt per row) ->
    [groups, n] leave-one-out advantages, in the dtype of ``scores``."""
    grouped = scores.float()
    n = grouped.shape[1]
    if n == 1:  # no other sample: no baseline (verl's choice)
        return scores.clone()
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (n - 1)  # [groups, n]
    return (grouped - others_mean).to(scores.dtype)


@register_estimator(
    "rloo", algorithms=("grpo",), phase=p.ADV, min_group_size=2,
    formula="A_i = r_i - mean_{j != i} r_j (leave-one-out baseline of the prompt's group)",
    source="Ahmadian et al. 2024 (arXiv 2402.14740); verl compute_rloo_outcome_advantage")
def rloo(x: AdvantageInputs, sums: Sums) -> AdvantageOutputs:
    """One leave-one-out advantage per response, on each of its tokens."""
    return AdvantageOutputs.per_sequence(rloo_advantages(x.grouped(x.rewards)), x)
