"""Advantage estimators: group-normalised (GRPO) and GAE (PPO).

Pure tensor functions. Groups never cross ranks (all samples of one prompt are
produced and scored on one rank, and the ``adv`` phase gets whole groups:
docs/trainer.md), so the group statistics need no communication.
"""

from __future__ import annotations

import torch


def group_normalized_advantages(rewards: torch.Tensor, n_samples_per_prompt: int,
                                eps: float = 1e-6, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO advantages: each sample's reward relative to its prompt's group.

    A_i = (r_i - mean_g) / (std_g + eps)   (``norm_by_std``; else A_i = r_i - mean_g)

    where g is the group of the ``n_samples_per_prompt`` consecutive samples of one
    prompt and std_g is the *unbiased* sample standard deviation (``torch.std``,
    divisor n - 1), as verl's GRPO does. A group whose rewards are all equal gets
    zero advantages (no learning signal), not NaN. A group of one sample has no
    spread: as in verl, mean 0 and std 1 are used, so A = r.

    rewards: [num_groups * n] or [num_groups, n] (samples of a prompt consecutive)
    returns: advantages of the same shape and dtype as ``rewards``.
    """
    n = int(n_samples_per_prompt)
    if n < 1:
        raise ValueError(f"n_samples_per_prompt={n} must be >= 1")
    if rewards.numel() % n != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of "
                         f"n_samples_per_prompt={n}")
    if rewards.dim() == 2 and rewards.shape[1] != n:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not "
                         f"[num_groups, n_samples_per_prompt={n}]")
    grouped = rewards.reshape(-1, n).float()  # [num_groups, n]
    if n == 1:
        mean = torch.zeros_like(grouped)
        std = torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)  # [num_groups, 1]
        std = grouped.std(dim=1, keepdim=True)  # unbiased, [num_groups, 1]
    centred = grouped - mean
    advantages = centred / (std + eps) if norm_by_std else centred
    return advantages.reshape(rewards.shape).to(rewards.dtype)


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every response token its sample's value; padding gets 0.

    per_sample: [batch]; mask: [batch, resp_len] -> [batch, resp_len]
    """
    if per_sample.dim() != 1 or per_sample.shape[0] != mask.shape[0]:
        raise ValueError(f"per-sample values of shape {tuple(per_sample.shape)} do not match "
                         f"the response mask of shape {tuple(mask.shape)}")
    return per_sample[:, None] * mask.to(per_sample.dtype)


def gae_advantages(rewards_per_token: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses (PPO).

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t            (the critic's regression target)

    V_{t+1} and A_{t+1} are those of the next *unmasked* token, and 0 after the
    last one: the value past the end of a response is the terminal 0, not the
    critic's output on a padding position. Masked positions come back as 0.
    With gamma = lam = 1, A_t = (sum_{k>=t} r_k) - V_t (reward-to-go minus value).
    Whitening, if wanted, is the caller's (``whiten_over_ranks``), since its
    statistics span ranks.

    rewards_per_token, values, mask: [batch, resp_len]
    returns: (advantages [batch, resp_len], returns [batch, resp_len])
    """
    if not (rewards_per_token.shape == values.shape == mask.shape):
        raise ValueError(f"rewards {tuple(rewards_per_token.shape)}, values "
                         f"{tuple(values.shape)} and mask {tuple(mask.shape)} must have one "
                         "shape [batch, resp_len]")
    with torch.no_grad():
        rewards_f = rewards_per_token.float()
        values_f = values.float()
        mask_f = mask.float()
        next_values = torch.zeros_like(values_f[:, 0])  # [batch]
        next_advantage = torch.zeros_like(values_f[:, 0])  # [batch]
        advantages_reversed = []
        for t in reversed(range(values_f.shape[1])):
            delta = rewards_f[:, t] + gamma * next_values - values_f[:, t]
            advantage_t = delta + gamma * lam * next_advantage
            keep = mask_f[:, t]
            # Padding (or masked interior tokens) passes the later value and
            # advantage through unchanged instead of resetting them.
            next_values = values_f[:, t] * keep + next_values * (1 - keep)
            next_advantage = advantage_t * keep + next_advantage * (1 - keep)
            advantages_reversed.append(advantage_t)
        advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask_f
        returns = (advantages + values_f) * mask_f
    return advantages.to(values.dtype), returns.to(values.dtype)


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor,
                        kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards of PPO: the sequence score on the last response token, minus
    ``kl_coef`` x the per-token KL everywhere (the KL-in-reward penalty; none when ``kl``
    is None).

    scores: [batch]; mask: [batch, resp_len]; kl: [batch, resp_len] -> [batch, resp_len]
    """
    mask_f = mask.float()
    lengths = mask_f.sum(dim=1).long()  # [batch]
    rewards = torch.zeros_like(mask_f)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    rewards[rows, lengths[rows] - 1] = scores.float()[rows]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl.float() * mask_f
    return rewards

