"""REINFORCE++ (Hu 2025, arXiv 2501.03262): REINFORCE with PPO's clipped loss and no
critic, its advantages normalised over the whole batch instead of per prompt.

- ``reinforce_plus_plus``: the discounted return of each token of the per-token reward
  (the sequence score on the last token, minus ``kl_coef`` x the KL to the reference on
  every token when ``use_kl_in_reward``), whitened over every token of the batch:

      G_t = sum_{k >= t} gamma^(k - t) r_k ;   A_t = (G_t - mean) / sqrt(var + 1e-8)

- ``reinforce_plus_plus_baseline``: the sequence reward minus its group's mean (a group of
  one: minus 0), given to every token of the response, then whitened over every token of
  the batch:

      A_i = whiten_batch(r_i - mean_g)

The batch statistics are token-weighted and unbiased (divisor N - 1 over the N response
tokens), as verl's ``masked_whiten``; they span every rank, so the phase reduces them
(``trainer/phases.py``) and ``masked_whiten`` below is the one-batch form the tests use.
Same definitions as verl's ``compute_reinforce_plus_plus_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage``, except that a masked token
*inside* a response (a multi-turn tool response) passes the return through instead of
resetting it (docs/algorithms.md).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.family import Estimator
from mindspeed_rl.algorithms.masked import masked_whiten


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next unmasked token (0 after the last one);
    masked positions come back as 0.

    rewards, mask: [batch, resp_len] -> returns [batch, resp_len] (float32)
    """
    if rewards.shape != mask.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and mask {tuple(mask.shape)} must "
                         "have one shape [batch, resp_len]")
    rewards_f, mask_f = rewards.float(), mask.float()
    returns = torch.zeros_like(rewards_f)
    running = torch.zeros_like(rewards_f[:, 0])  # [batch]
    for t in reversed(range(rewards_f.shape[1])):
        keep = mask_f[:, t]
        candidate = rewards_f[:, t] + gamma * running
        running = candidate * keep + running * (1 - keep)
        returns[:, t] = candidate * keep
    return returns


def reinforce_plus_plus_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                                   gamma: float) -> torch.Tensor:
    """One batch's REINFORCE++ advantages: whitened discounted returns.
    [batch, resp_len] -> [batch, resp_len]"""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def group_mean_baseline(scores: torch.Tensor) -> torch.Tensor:
    """[groups, n] sequence rewards -> [groups, n] rewards minus their group's mean (a
    group of one keeps its reward). The batch whitening follows in the phase."""
    grouped = scores.float()
    if grouped.shape[1] == 1:
        return scores.clone()
    return (grouped - grouped.mean(dim=1, keepdim=True)).to(scores.dtype)


REINFORCE_PLUS_PLUS = Estimator(
    name="reinforce_plus_plus", algorithms=("grpo",), phase=p.DISCOUNTED_RETURNS,
    fn=discounted_returns, params=("gamma",), whiten_batch=True, kl_in_reward=True,
    formula="A_t = whiten_batch(sum_{k >= t} gamma^(k-t) r_k), r = score on the last token "
            "(- KL per token with use_kl_in_reward)",
    source="Hu 2025 (arXiv 2501.03262); verl compute_reinforce_plus_plus_outcome_advantage",
)

REINFORCE_PLUS_PLUS_BASELINE = Estimator(
    name="reinforce_plus_plus_baseline", algorithms=("grpo",), phase=p.ADV,
    fn=group_mean_baseline, whiten_batch=True, min_group_size=2,
    formula="A_i = whiten_batch(r_i - mean_g) (group-mean baseline, then batch whitening)",
    source="Hu 2025 (arXiv 2501.03262); verl "
           "compute_reinforce_plus_plus_baseline_outcome_advantage",
)
