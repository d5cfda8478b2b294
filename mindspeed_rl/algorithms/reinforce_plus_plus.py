"""REINFORCE++ (Hu 2025, arXiv 2501.03262): REINFORCE with PPO's clipped loss and no
critic, its advantages normalised over the whole batch instead of per prompt.

- ``reinforce_plus_plus``: the discounted return of each token of the per-token reward
  (the sequence score on the last token, minus ``kl_coef`` x the KL to the reference on
  every token when ``use_kl_in_reward``), whitened over every token of the batch:

      G_t = sum_{k >= t} gamma^(k - t) r_k ;   A_t = (G_t - mean) / sqrt(var + 1e-8)

  The discounted return is GAE's advantage with no critic (V = 0) and lambda = 1, so it is
  computed by ``gae_advantages``.

- ``reinforce_plus_plus_baseline``: the sequence reward minus its group's mean (a group of
  one: minus 0), given to every token of the response, then whitened over every token of
  the batch (the tokens the loss trains):

      A_i = whiten_batch(r_i - mean_g)

The batch statistics are token-weighted and unbiased (divisor N - 1 over the N response
tokens), as verl's ``masked_whiten``; they span every rank, so the estimators whiten with
``whiten_over_ranks`` and the sums the trainer passes in. Same definitions as verl's
``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (docs/algorithms.md).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.advantages import gae_advantages, token_level_rewards
from mindspeed_rl.algorithms.estimator import AdvantageInputs, AdvantageOutputs, Sums
from mindspeed_rl.algorithms.masked import whiten_over_ranks
from mindspeed_rl.algorithms.registry import register_estimator


def group_mean_baseline(scores: torch.Tensor) -> torch.Tensor:
    """[groups, n] sequence rewards -> [groups, n] rewards minus their group's mean (a
    group of one keeps its reward). The batch whitening follows."""
    grouped = scores.float()
    if grouped.shape[1] == 1:
        return scores.clone()
    return (grouped - grouped.mean(dim=1, keepdim=True)).to(scores.dtype)


@register_estimator(
    "reinforce_plus_plus", algorithms=("grpo",), phase=p.DISCOUNTED_RETURNS, params=("gamma",),
    kl_in_reward=True,
    formula="A_t = whiten_batch(sum_{k >= t} gamma^(k-t) r_k), r = score on the last token "
            "(- KL per token with use_kl_in_reward)",
    source="Hu 2025 (arXiv 2501.03262); verl compute_reinforce_plus_plus_outcome_advantage")
def reinforce_plus_plus(x: AdvantageInputs, sums: Sums, gamma: float) -> AdvantageOutputs:
    """Whitened discounted returns of the per-token reward (GAE with V = 0, lambda = 1)."""
    mask = x.response_mask
    rewards = token_level_rewards(x.rewards, mask, x.kl, x.kl_coef)
    returns, _ = gae_advantages(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return AdvantageOutputs(whiten_over_ranks(returns, mask, sums))


@register_estimator(
    "reinforce_plus_plus_baseline", algorithms=("grpo",), phase=p.ADV, min_group_size=2,
    formula="A_i = whiten_batch(r_i - mean_g) (group-mean baseline, then batch whitening)",
    source="Hu 2025 (arXiv 2501.03262); verl "
           "compute_reinforce_plus_plus_baseline_outcome_advantage")
def reinforce_plus_plus_baseline(x: AdvantageInputs, sums: Sums) -> AdvantageOutputs:
    """The group-mean baseline on every token, whitened over the batch's trained tokens."""
    centred = AdvantageOutputs.per_sequence(group_mean_baseline(x.grouped(x.rewards)), x)
    return AdvantageOutputs(whiten_over_ranks(centred.advantages, x.loss_mask, sums))
