"""The clipped surrogate policy loss (PPO / GRPO / DAPO) and loss aggregation.

Pure tensor functions. Under data parallelism the *caller* supplies the global
normalisers (``num_tokens_global``, ``num_seqs_global``), so a token-mean over the
whole global batch is exact however the tokens are spread over ranks and
micro-batches.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.masked import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             num_tokens_global: float | None = None,
             num_seqs_global: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean`` (DAPO's token-level loss):
      sum_{i,t} m_it * l_it / N_tok, with N_tok = ``num_tokens_global`` if given,
      else sum(m) of this batch.
    - ``seq-mean-token-mean`` (original GRPO):
      (1 / N_seq) * sum_i [sum_t m_it * l_it / sum_t m_it]
    - ``seq-mean-token-sum``:
      (1 / N_seq) * sum_i sum_t m_it * l_it
    with N_seq = ``num_seqs_global`` if given, else the number of rows of this batch
    that have at least one response token.

    With the global normalisers, the returned value is this batch's *share* of
    the global mean: the global loss is the SUM of the shares over micro-batches
    and data-parallel ranks. A framework that averages gradients over DP ranks
    (or over micro-batches) must therefore scale the share back up by that count.

    loss_mat, mask: [batch, resp_len] -> scalar
    """
    mask_f = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if num_tokens_global is None:
            return masked_mean(loss_mat, mask_f)
        return (loss_mat * mask_f).sum() / max(float(num_tokens_global), 1.0)
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens_per_seq = mask_f.sum(dim=-1)  # [batch]
        seq_sums = (loss_mat * mask_f).sum(dim=-1)  # [batch]
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_sums / tokens_per_seq.clamp(min=1.0)
        else:
            seq_losses = seq_sums
        if num_seqs_global is None:
            num_seqs = float((tokens_per_seq > 0).sum().item())
        else:
            num_seqs = float(num_seqs_global)
        return seq_losses.sum() / max(num_seqs, 1.0)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid ones are "
                     f"{list(LOSS_AGG_MODES)}")


def policy_loss(logprobs: torch.Tensor, logprobs_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                loss_agg_mode: str = "token-mean", num_tokens_global: float | None = None,
                num_seqs_global: float | None = None, clip_ratio_dual: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, with asymmetric clipping (DAPO clip-higher).

    ratio_t = exp(logp_t - logp_old_t)           (the log-ratio clamped to [-20, 20])
    l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    i.e. for A > 0 the ratio is capped at 1 + clip_ratio_high, for A < 0 at
    1 - clip_ratio_low. With ``clip_ratio_dual`` = c > 1 (dual-clip PPO), tokens with
    A < 0 are further bounded: l_t = min(l_t, -A_t * c).
    The per-token losses are reduced by ``agg_loss(loss_agg_mode, num_tokens_global,
    num_seqs_global)``.

    logprobs: current policy log-probs of the response tokens (with grad),
    logprobs_old: the behaviour policy's (no grad), both [batch, resp_len];
    advantages: [batch, resp_len], or [batch] broadcast to every token;
    mask: [batch, resp_len] response mask.

    returns: (loss scalar, stats) with detached scalar stats over the masked tokens:
      ``pg_clipfrac``: fraction of tokens where the clipped branch is the active one,
      ``pg_clipfrac_lower``: fraction bounded by the dual clip (0 without it),
      ``approx_kl``: mean(logp_old - logp) (first-order KL of old vs new),
      ``ratio_mean``: mean ratio, ``pg_loss``: the loss value.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    if not (logprobs.shape == logprobs_old.shape == advantages.shape == mask.shape):
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, logprobs_old "
                         f"{tuple(logprobs_old.shape)}, advantages {tuple(advantages.shape)} "
                         f"and mask {tuple(mask.shape)} must have one shape [batch, resp_len]")
    mask_f = mask.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - logprobs_old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(losses_unclipped, losses_clipped)
    clipped = (losses_clipped > losses_unclipped).to(logprobs.dtype)
    clipped_lower = torch.zeros_like(clipped)
    if clip_ratio_dual is not None:
        if clip_ratio_dual <= 1.0:
            raise ValueError(f"clip_ratio_dual={clip_ratio_dual} must be > 1")
        bound = -advantages * clip_ratio_dual
        dual_active = (advantages < 0) & (losses > bound)
        losses = torch.where(dual_active, bound, losses)
        clipped_lower = dual_active.to(logprobs.dtype)
    loss = agg_loss(losses, mask_f, loss_agg_mode, num_tokens_global, num_seqs_global)
    with torch.no_grad():
        stats = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": masked_mean(clipped, mask_f),
            "pg_clipfrac_lower": masked_mean(clipped_lower, mask_f),
            "approx_kl": masked_mean(-log_ratio, mask_f),
            "ratio_mean": masked_mean(ratio, mask_f),
        }
    return loss, stats
