"""The clipped value loss of the PPO critic, and how much of the returns it explains."""

from __future__ import annotations

import math

import torch

from mindspeed_rl.algorithms.masked import masked_mean
from mindspeed_rl.algorithms.policy_loss import agg_loss


def value_loss(values: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip_range_value: float, loss_agg_mode: str = "token-mean",
               num_tokens_global: float | None = None, num_seqs_global: float | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with value clipping.

    V_clip_t = V_old_t + clip(V_t - V_old_t, -clip_range_value, clip_range_value)
    l_t      = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)
    reduced with ``agg_loss`` (same modes and global normalisers as the policy loss).

    values: the critic's current predictions (with grad), values_old: at rollout
    time, returns: GAE returns, mask: response mask; all [batch, resp_len].
    returns: (loss scalar, {"vf_loss", "vf_clipfrac"}) where vf_clipfrac is the
    fraction of tokens where the clipped branch is active.
    """
    if not (values.shape == values_old.shape == returns.shape == mask.shape):
        raise ValueError(f"values {tuple(values.shape)}, values_old {tuple(values_old.shape)}, "
                         f"returns {tuple(returns.shape)} and mask {tuple(mask.shape)} must "
                         "have one shape [batch, resp_len]")
    # Clamped directly to [V_old - c, V_old + c] (verl's clip_by_value): inside the range it
    # returns V_t itself, so the two branches tie exactly and vf_clipfrac counts only real
    # clipping (V_old + clamp(V_t - V_old) rounds, and the comparison below flipped on noise).
    values_clipped = torch.clamp(values, values_old - clip_range_value,
                                 values_old + clip_range_value)
    losses_unclipped = (values - returns).square()
    losses_clipped = (values_clipped - returns).square()
    losses = 0.5 * torch.maximum(losses_unclipped, losses_clipped)
    loss = agg_loss(losses, mask, loss_agg_mode, num_tokens_global, num_seqs_global)
    with torch.no_grad():
        stats = {"vf_loss": loss.detach(),
                 "vf_clipfrac": masked_mean((losses_clipped > losses_unclipped).float(), mask)}
    return loss, stats


def explained_variance(sum_returns: float, sum_returns_sq: float, sum_residual: float,
                       sum_residual_sq: float, count: float, rel_eps: float = 1e-6) -> float:
    """1 - Var[R - V] / Var[R] over ``count`` tokens, from (globally reduced) sums of the
    returns R, their squares, the residuals R - V and their squares (verl's
    ``vf_explained_var``).

    Undefined when the returns do not vary (e.g. every reward 0 in a batch): NaN when
    Var[R] <= ``rel_eps`` * E[R^2], instead of a huge number from rounding noise over a
    variance of about 0 (verl adds 1e-5 to the denominator, which gives -1e5-sized
    values there).
    """
    n = max(count, 1.0)
    mean_sq = sum_returns_sq / n
    var_returns = mean_sq - (sum_returns / n) ** 2
    var_residual = sum_residual_sq / n - (sum_residual / n) ** 2
    if count <= 1 or var_returns <= rel_eps * mean_sq:
        return math.nan
    return 1.0 - var_residual / var_returns
