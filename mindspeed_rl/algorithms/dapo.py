"""DAPO's reward shaping and sample filter (arXiv 2503.14476): the overlong
penalty and dynamic sampling. Clip-higher and the token-level loss are
``policy_loss(clip_ratio_high=...)`` and ``loss_agg_mode="token-mean"``."""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int,
                     overlong_buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """Soft overlong punishment, added to the rule reward.

    With L_max = ``max_response_length`` and buffer B, a response of |y| tokens gets
        0                                   if |y| <= L_max - B
        -(|y| - (L_max - B)) / B * factor   if L_max - B < |y| <= L_max
        -factor                             if |y| > L_max  (cannot happen when
                                            generation stops at L_max; kept bounded)

    response_lengths: [N] (ints) -> [N] float32
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(f"overlong_buffer_len={overlong_buffer_len} must be in "
                         f"(0, max_response_length={max_response_length}]")
    expected_len = max_response_length - overlong_buffer_len
    excess = response_lengths.float() - expected_len
    penalty = -excess / overlong_buffer_len * penalty_factor
    return torch.clamp(penalty, min=-penalty_factor, max=0.0)


def groups_with_reward_spread(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Dynamic sampling: which prompt groups carry a learning signal.

    A group whose ``n_samples_per_prompt`` values are all equal has zero
    group-normalised advantages, so DAPO drops it and samples more prompts. A group
    of one sample never has a spread. NaN values are an error (a verifier that
    returned NaN would otherwise decide silently).

    rewards: [num_groups * n] (samples of one prompt consecutive) -> [num_groups] bool
    """
    if torch.isnan(rewards).any():
        bad = int(torch.nonzero(torch.isnan(rewards.reshape(-1)))[0])
        raise ValueError(f"dynamic sampling: the filter metric of row {bad} (group "
                         f"{bad // n_samples_per_prompt}) is NaN")
    if rewards.numel() % n_samples_per_prompt:
        raise ValueError(f"{rewards.numel()} values do not split into groups of "
                         f"n_samples_per_prompt={n_samples_per_prompt}")
    grouped = rewards.reshape(-1, n_samples_per_prompt)  # [num_groups, n]
    return grouped.max(dim=1).values > grouped.min(dim=1).values
