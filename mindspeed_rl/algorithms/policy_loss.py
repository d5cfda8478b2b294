"""The clipped surrogate policy loss (PPO / GRPO / DAPO) and loss aggregation.

Pure tensor functions. Under data parallelism the *caller* supplies the global
normalisers (``num_tokens_global``, ``num_seqs_global``), so a token-mean over the
whole global batch is exact however the tokens are spread over ranks and
micro-batches.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.masked import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")


def default_loss_agg_mode(policy_loss_name: str) -> str:
    """The aggregation a policy loss is defined with: GSPO's objective is the mean over
    sequences of each sequence's token mean (Zheng et al. 2025, eq. 5:
    ``seq-mean-token-mean``); the vanilla PPO/DAPO loss here defaults to DAPO's
    ``token-mean``."""
    return "seq-mean-token-mean" if policy_loss_name == "gspo" else "token-mean"


def sequence_sums(values: torch.Tensor, mask: torch.Tensor,
                  segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of masked ``values`` and token counts: ``([seqs], [seqs])``.

    A sequence is a row of ``[batch, resp_len]``, or, with ``segment_ids`` (``[batch,
    resp_len]`` int64, the sequence of each position, any value on masked positions), a
    run of positions sharing an id: several responses packed along one row.
    """
    mask_f = mask.to(values.dtype)
    if segment_ids is None:
        return (values * mask_f).sum(dim=-1), mask_f.sum(dim=-1)
    ids = torch.where(mask_f > 0, segment_ids, torch.zeros_like(segment_ids)).reshape(-1)
    size = int(ids.max().item()) + 1 if ids.numel() else 0
    sums = torch.zeros(size, dtype=values.dtype).index_add(0, ids, (values * mask_f).reshape(-1))
    counts = torch.zeros(size, dtype=values.dtype).index_add(0, ids, mask_f.reshape(-1))
    return sums, counts


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             num_tokens_global: float | None = None,
             num_seqs_global: float | None = None,
             norm_length: float | None = None,
             segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    - ``token-mean`` (DAPO's token-level loss):
      sum_{i,t} m_it * l_it / N_tok, with N_tok = ``num_tokens_global`` if given,
      else sum(m) of this batch.
    - ``seq-mean-token-mean`` (original GRPO):
      (1 / N_seq) * sum_i [sum_t m_it * l_it / sum_t m_it]
    - ``seq-mean-token-sum``:
      (1 / N_seq) * sum_i sum_t m_it * l_it
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): the token sum over a constant length,
      (1 / N_seq) * sum_i sum_t m_it * l_it / L with L = ``norm_length`` (the generation
      budget, e.g. max_tokens), so a response's weight does not depend on its length
    with N_seq = ``num_seqs_global`` if given, else the number of rows of this batch
    that have at least one response token.

    With the global normalisers, the returned value is this batch's *share* of
    the global mean: the global loss is the SUM of the shares over micro-batches
    and data-parallel ranks. A framework that averages gradients over DP ranks
    (or over micro-batches) must therefore scale the share back up by that count.

    ``segment_ids`` (see `sequence_sums`) lets one row hold several packed sequences.

    loss_mat, mask: [batch, resp_len] -> scalar
    """
    mask_f = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        if num_tokens_global is None:
            return masked_mean(loss_mat, mask_f)
        return (loss_mat * mask_f).sum() / max(float(num_tokens_global), 1.0)
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_sums, tokens_per_seq = sequence_sums(loss_mat, mask_f, segment_ids)  # [seqs]
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_sums / tokens_per_seq.clamp(min=1.0)
        elif loss_agg_mode == "seq-mean-token-sum-norm":
            if not norm_length or norm_length <= 0:
                raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (the "
                                 "generation budget, e.g. max_tokens)")
            seq_losses = seq_sums / float(norm_length)
        else:
            seq_losses = seq_sums
        if num_seqs_global is None:
            num_seqs = float((tokens_per_seq > 0).sum().item())
        else:
            num_seqs = float(num_seqs_global)
        return seq_losses.sum() / max(num_seqs, 1.0)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid ones are "
                     f"{list(LOSS_AGG_MODES)}")


def truncated_is_weights(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor,
                         threshold: float) -> torch.Tensor:
    """Truncated importance weights of the rollout engine's samples (no gradient).

    w_t = min(exp(logp_old_t - logp_rollout_t), threshold): the policy the loss
    assumes (the training engine's old log-probs) over the one that sampled (vLLM,
    e.g. in bf16), capped so a few tokens cannot dominate.

    logprobs_old, logprobs_rollout: [batch, resp_len] -> [batch, resp_len]
    """
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold={threshold} must be > 0")
    log_w = (logprobs_old - logprobs_rollout).detach().clamp(max=20.0)
    return torch.exp(log_w).clamp(max=threshold)


# Truncation of the off-policy weights of a partial rollout when rollout_is_threshold is
# unset (verl's default truncation threshold for rollout correction).
OFF_POLICY_IS_THRESHOLD = 2.0


def off_policy_is_weights(logprobs_proximal: torch.Tensor, logprobs_behaviour: torch.Tensor,
                          off_policy: torch.Tensor, threshold: float,
                          on_policy_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token importance weights of a partial rollout (decoupled PPO, no gradient).

    A token an older policy generated (``off_policy`` = 1) weighs
    min(exp(logp_proximal - logp_behaviour), threshold): the proximal policy (the old
    log-probs recomputed this iteration, which the ratio is clipped against) over the
    policy that sampled it (its own rollout log-prob). The other tokens weigh
    ``on_policy_weights`` (1, or the rollout-mismatch weights of ``rollout_is_threshold``).
    A response continued across iterations mixes both, token by token.

    all: [batch, resp_len] -> [batch, resp_len]
    """
    weights = truncated_is_weights(logprobs_proximal, logprobs_behaviour, threshold)
    base = on_policy_weights if on_policy_weights is not None else torch.ones_like(weights)
    return torch.where(off_policy > 0, weights, base)


def _sequence_log_ratio(log_ratio: torch.Tensor, logprobs: torch.Tensor, mask_f: torch.Tensor,
                        segment_ids: torch.Tensor | None) -> torch.Tensor:
    """GSPO: each token's log-ratio becomes its sequence's mean log-ratio in value, with the
    gradient of its own token's log-prob."""
    sums, counts = sequence_sums(log_ratio, mask_f, segment_ids)
    seq_log_ratio = (sums / counts.clamp(min=1.0)).detach()  # [seqs]
    if segment_ids is None:
        per_token = seq_log_ratio[:, None]
    else:
        per_token = seq_log_ratio[segment_ids.clamp(0, max(len(seq_log_ratio) - 1, 0))]
    return torch.clamp(per_token + logprobs - logprobs.detach(), min=-20.0, max=20.0)


def policy_loss(logprobs: torch.Tensor, logprobs_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                loss_agg_mode: str = "token-mean", num_tokens_global: float | None = None,
                num_seqs_global: float | None = None, clip_ratio_dual: float | None = None,
                *, ratio_level: str = "token", is_weights: torch.Tensor | None = None,
                norm_length: float | None = None, segment_ids: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, with asymmetric clipping (DAPO clip-higher).

    ratio_t = exp(logp_t - logp_old_t)           (the log-ratio clamped to [-20, 20])
    l_t     = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    i.e. for A > 0 the ratio is capped at 1 + clip_ratio_high, for A < 0 at
    1 - clip_ratio_low. With ``clip_ratio_dual`` = c > 1 (dual-clip PPO), tokens with
    A < 0 are further bounded: l_t = min(l_t, -A_t * c).

    ``ratio_level="sequence"`` is GSPO (Zheng et al. 2025): every token of response i
    uses the sequence ratio s_i = exp(mean_t(logp_t - logp_old_t)) in value, with the
    gradient of its own token (s_i * exp(logp_t - sg(logp_t))), clipped as above; its
    useful clip ranges are small (e.g. 3e-4 / 4e-4).

    ``is_weights`` (truncated importance weights of the rollout engine's samples,
    `truncated_is_weights`) multiply each token's loss. The per-token losses are reduced
    by ``agg_loss(loss_agg_mode, num_tokens_global, num_seqs_global, norm_length,
    segment_ids)``; ``segment_ids`` also delimits GSPO's sequences when rows are packed.

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
    if ratio_level == "sequence":
        log_ratio = _sequence_log_ratio(log_ratio, logprobs, mask_f, segment_ids)
    elif ratio_level != "token":
        raise ValueError(f"ratio_level {ratio_level!r} is neither token nor sequence")
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
    if is_weights is not None:
        losses = losses * is_weights
    loss = agg_loss(losses, mask_f, loss_agg_mode, num_tokens_global, num_seqs_global,
                    norm_length, segment_ids)
    with torch.no_grad():
        stats = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": masked_mean(clipped, mask_f),
            "pg_clipfrac_lower": masked_mean(clipped_lower, mask_f),
            "approx_kl": masked_mean(-log_ratio, mask_f),
            "ratio_mean": masked_mean(ratio, mask_f),
        }
    return loss, stats
