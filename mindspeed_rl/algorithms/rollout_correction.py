"""Rollout correction: the training–inference mismatch seen and corrected (verl's keys).

The rollout engine (vLLM, e.g. bf16) and the training engine (megatron, fp32) compute
the same policy with different kernels, so a sampled token's rollout log-prob
``logp_rollout`` and the training engine's ``logp_old`` differ. With the per-token log
ratio ``r_t = logp_old_t - logp_rollout_t`` (training over rollout):

- **IS weights** (``rollout_is``): ``token``: w_t = exp(r_t); ``sequence``:
  w_t = exp(sum_t r_t) for every token of the sequence. Truncated above at
  ``rollout_is_threshold`` (and below at ``rollout_is_threshold_lower`` when given),
  zero on padding, detached; ``rollout_is_batch_normalize`` divides them by their mean
  over the batch (over tokens for ``token``, over sequences for ``sequence``).
- **Rejection** (``rollout_rs``): a token (``token``: exp(r_t)), a whole sequence
  (``sequence``: exp(sum r_t); ``geometric``: exp(mean r_t)) whose ratio lies outside
  [``rollout_rs_threshold_lower`` (default 1 / upper), ``rollout_rs_threshold``] leaves
  the loss (its mask becomes 0). ``token`` with a two-sided band is IcePop's masking.
- **Veto** (``rollout_token_veto_threshold``): a sequence with any token whose ratio is
  below the threshold leaves the loss entirely.

Exponents are clamped to [-20, 20] (``SAFETY_BOUND``). Every function takes
``[batch, resp_len]`` tensors and, optionally, ``segment_ids`` (``[batch, resp_len]``,
the sequence of each position, see ``policy_loss.sequence_sums``) when several sequences
are packed along one row. Diagnostics are formed from sums (``mismatch_sums``) so that
micro-batches and data-parallel ranks add them up before ``mismatch_metrics`` divides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mindspeed_rl.algorithms.policy_loss import sequence_sums

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
DEFAULT_IS_THRESHOLD = 2.0  # verl's rollout_is_threshold default


@dataclass(frozen=True)
class RolloutCorrection:
    """The rollout-correction settings of ``rl_config`` (verl's key names, ``rollout_``
    prefix dropped). ``is_level`` None = no IS weights; ``rs_level`` None = no rejection;
    ``veto_threshold`` None = no veto."""

    is_level: str | None = None
    is_threshold: float = DEFAULT_IS_THRESHOLD
    is_threshold_lower: float | None = None
    is_batch_normalize: bool = False
    rs_level: str | None = None
    rs_threshold: float | None = None
    rs_threshold_lower: float | None = None
    veto_threshold: float | None = None

    @property
    def enabled(self) -> bool:
        return (self.is_level is not None or self.rs_level is not None
                or self.veto_threshold is not None)

    @classmethod
    def from_rl(cls, rl) -> "RolloutCorrection":
        """From ``rl_config``. ``rollout_is`` unset keeps the older meaning of
        ``rollout_is_threshold`` alone (token weights applied by the caller), so this one
        is off then."""
        level = getattr(rl, "rollout_is", None)
        threshold = getattr(rl, "rollout_is_threshold", None)
        return cls(is_level=level,
                   is_threshold=DEFAULT_IS_THRESHOLD if threshold is None else threshold,
                   is_threshold_lower=getattr(rl, "rollout_is_threshold_lower", None),
                   is_batch_normalize=bool(getattr(rl, "rollout_is_batch_normalize", False)),
                   rs_level=getattr(rl, "rollout_rs", None),
                   rs_threshold=getattr(rl, "rollout_rs_threshold", None),
                   rs_threshold_lower=getattr(rl, "rollout_rs_threshold_lower", None),
                   veto_threshold=getattr(rl, "rollout_token_veto_threshold", None))


def _per_sequence(values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None,
                  reduce: str) -> tuple[torch.Tensor, torch.Tensor]:
    """([seqs] sum or mean of ``values`` per sequence, [seqs] token counts)."""
    sums, counts = sequence_sums(values, mask, segment_ids)
    if reduce == "mean":
        sums = sums / counts.clamp(min=1.0)
    return sums, counts


def _broadcast(per_seq: torch.Tensor, like: torch.Tensor,
               segment_ids: torch.Tensor | None) -> torch.Tensor:
    """[seqs] -> [batch, resp_len]: each position takes its sequence's value."""
    if segment_ids is None:
        return per_seq[:, None].expand_as(like)
    return per_seq[segment_ids.clamp(0, max(len(per_seq) - 1, 0))]


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                    segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The log-ratio at ``level``, per position: ``token``: r_t; ``sequence``: sum of the
    sequence's r_t; ``geometric``: their mean (log of the geometric-mean ratio)."""
    if level == "token":
        return log_ratio
    if level not in ("sequence", "geometric"):
        raise ValueError(f"level {level!r} is none of token, sequence, geometric")
    mask_f = mask.to(log_ratio.dtype)
    per_seq, _ = _per_sequence(log_ratio, mask_f, segment_ids,
                               "sum" if level == "sequence" else "mean")
    return _broadcast(per_seq, log_ratio, segment_ids)


def rollout_is_weights(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor,
                       mask: torch.Tensor, level: str = "token",
                       threshold: float = DEFAULT_IS_THRESHOLD,
                       threshold_lower: float | None = None,
                       segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Truncated IS weights (no gradient), 0 on padding:
    clamp(exp(clamp(level_log_ratio, ±20)), threshold_lower, threshold)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} is neither token nor sequence")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold={threshold} must be > 0")
    if threshold_lower is not None and not 0 <= threshold_lower < threshold:
        raise ValueError(f"rollout_is_threshold_lower={threshold_lower} must lie in "
                         f"[0, rollout_is_threshold={threshold})")
    mask_f = mask.to(logprobs_old.dtype)
    log_ratio = (logprobs_old - logprobs_rollout).detach()
    log_w = level_log_ratio(log_ratio, mask_f, level, segment_ids)
    weights = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask_f
    weights = weights.clamp(min=threshold_lower, max=threshold) if threshold_lower is not None \
        else weights.clamp(max=threshold)
    return weights * mask_f


def is_weight_mean_sums(weights: torch.Tensor, mask: torch.Tensor, level: str,
                        segment_ids: torch.Tensor | None = None) -> tuple[float, float]:
    """(sum, count) whose ratio is the batch mean ``rollout_is_batch_normalize`` divides
    by: over tokens (``token``), over sequences (``sequence``, each its weight once)."""
    mask_f = mask.to(weights.dtype)
    if level == "token":
        return float((weights * mask_f).sum()), float(mask_f.sum())
    per_seq, counts = _per_sequence(weights, mask_f, segment_ids, "mean")
    real = counts > 0
    return float(per_seq[real].sum()), float(real.sum())


def normalize_weights(weights: torch.Tensor, total: float, count: float) -> torch.Tensor:
    """``weights`` over their batch mean ``total / count`` (unchanged when ~0)."""
    mean = total / max(count, 1e-8)
    return weights / mean if mean > 1e-8 else weights


def rejection_mask(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor,
                   mask: torch.Tensor, level: str, threshold: float,
                   threshold_lower: float | None = None,
                   segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """1 where the ratio at ``level`` lies in [lower, upper] (lower = 1 / upper unless
    given), 0 elsewhere and on padding (float, same shape)."""
    if level not in RS_LEVELS:
        raise ValueError(f"rollout_rs={level!r} is none of {list(RS_LEVELS)}")
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    if not 0 <= lower < threshold:
        raise ValueError(f"rollout_rs_threshold_lower={lower} must lie in "
                         f"[0, rollout_rs_threshold={threshold})")
    mask_f = mask.to(logprobs_old.dtype)
    log_ratio = (logprobs_old - logprobs_rollout).detach()
    ratio = torch.exp(level_log_ratio(log_ratio, mask_f, level, segment_ids)
                      .clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return ((ratio >= lower) & (ratio <= threshold)).to(mask_f.dtype) * mask_f


def veto_mask(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor, mask: torch.Tensor,
              threshold: float, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """0 on every token of a sequence holding a token with ratio < ``threshold``
    (a catastrophic token), else the mask (float)."""
    if threshold <= 0:
        raise ValueError(f"rollout_token_veto_threshold={threshold} must be > 0")
    mask_f = mask.to(logprobs_old.dtype)
    bad = ((logprobs_old - logprobs_rollout).detach() < math.log(threshold)).to(mask_f.dtype)
    per_seq, _ = _per_sequence(bad, mask_f, segment_ids, "sum")
    return (_broadcast(per_seq, mask_f, segment_ids) == 0).to(mask_f.dtype) * mask_f


def correct(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor, mask: torch.Tensor,
            rc: RolloutCorrection, segment_ids: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(IS weights or None, the loss mask after rejection and veto), as verl applies them:
    the weights are not zeroed by rejection, the rejected tokens leave the mask (and the
    loss's token count). Batch normalisation is the caller's (it needs the whole batch)."""
    weights = None
    if rc.is_level is not None:
        weights = rollout_is_weights(logprobs_old, logprobs_rollout, mask, rc.is_level,
                                     rc.is_threshold, rc.is_threshold_lower, segment_ids)
    keep = mask.to(logprobs_old.dtype)
    if rc.rs_level is not None:
        if rc.rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold")
        keep = keep * rejection_mask(logprobs_old, logprobs_rollout, mask, rc.rs_level,
                                     rc.rs_threshold, rc.rs_threshold_lower, segment_ids)
    if rc.veto_threshold is not None:
        keep = keep * veto_mask(logprobs_old, logprobs_rollout, mask, rc.veto_threshold,
                                segment_ids)
    return weights, keep


# ---------------------------------------------------------------------------------------
# diagnostics
# ---------------------------------------------------------------------------------------
MISMATCH_SUM_KEYS = ("mm_tokens", "mm_seqs", "mm_k1", "mm_k3", "mm_rho2", "mm_seq_rho2",
                     "mm_log_ppl_diff", "mm_log_ppl_abs_diff", "mm_ess_w", "mm_ess_w2",
                     "mm_ess_seq_w", "mm_ess_seq_w2", "mm_rs_masked", "mm_veto_masked",
                     "mm_veto_seqs", "mm_is_clipped")


def mismatch_sums(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor,
                  mask: torch.Tensor, threshold: float = DEFAULT_IS_THRESHOLD,
                  threshold_lower: float | None = None,
                  segment_ids: torch.Tensor | None = None,
                  keep_rs: torch.Tensor | None = None,
                  keep_veto: torch.Tensor | None = None) -> dict[str, float]:
    """Sums over the tokens / sequences of one batch (``MISMATCH_SUM_KEYS``) from which
    ``mismatch_metrics`` forms the diagnostics; add them over micro-batches and ranks
    first. The ESS sums use the token and the sequence weights clamped to [lower, upper]
    (lower = 1 / upper unless given), as verl's ESS does; ``keep_rs`` / ``keep_veto``
    (the masks after rejection / veto) count the tokens and sequences they removed."""
    mask_f = mask.to(torch.float32)
    old, roll = logprobs_old.detach().float(), logprobs_rollout.detach().float()
    lr = (old - roll) * mask_f
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    lower = 1.0 / threshold if threshold_lower is None else threshold_lower
    seq_lr, counts = _per_sequence(lr, mask_f, segment_ids, "sum")
    real = counts > 0
    seq_lr, counts = seq_lr[real], counts[real]
    old_mean, _ = _per_sequence(old, mask_f, segment_ids, "mean")
    roll_mean, _ = _per_sequence(roll, mask_f, segment_ids, "mean")
    log_ppl_diff = (roll_mean - old_mean)[real]
    w_tok = torch.exp(lr_safe).clamp(lower, threshold)
    w_seq_per = torch.exp(seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(lower, threshold)
    out = {
        "mm_tokens": mask_f.sum(),
        "mm_seqs": real.sum(),
        "mm_k1": (-lr * mask_f).sum(),
        "mm_k3": ((torch.exp(lr_safe) - lr_safe - 1.0) * mask_f).sum(),
        "mm_rho2": (torch.exp(2.0 * lr_safe) * mask_f).sum(),
        "mm_seq_rho2": torch.exp(2.0 * seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum(),
        "mm_log_ppl_diff": log_ppl_diff.sum(),
        "mm_log_ppl_abs_diff": log_ppl_diff.abs().sum(),
        "mm_ess_w": (w_tok * mask_f).sum(),
        "mm_ess_w2": (w_tok.square() * mask_f).sum(),
        # the sequence weight once per token of the sequence (verl's token-weighted ESS)
        "mm_ess_seq_w": (w_seq_per * counts).sum(),
        "mm_ess_seq_w2": (w_seq_per.square() * counts).sum(),
        "mm_is_clipped": (((lr_safe > math.log(threshold))
                           | (lr_safe < math.log(max(lower, 1e-30)))).float() * mask_f).sum(),
        "mm_rs_masked": ((1.0 - keep_rs.float()) * mask_f).sum() if keep_rs is not None else 0.0,
        "mm_veto_masked": ((1.0 - keep_veto.float()) * mask_f).sum()
        if keep_veto is not None else 0.0,
        "mm_veto_seqs": 0.0,
    }
    if keep_veto is not None:
        vetoed, _ = _per_sequence(1.0 - keep_veto.float(), mask_f, segment_ids, "sum")
        out["mm_veto_seqs"] = (vetoed[real] > 0).sum()
    return {k: float(v) for k, v in out.items()}


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The diagnostics from summed ``mismatch_sums`` (verl's names in brackets):

    - ``kl_k1``: mean_t(logp_rollout - logp_old) (``kl``), ``kl_k3``: mean_t(e^r - r - 1)
      (``k3_kl``): KL(rollout || training) estimators;
    - ``chi2_token``: mean_t(e^{2r}) - 1, ``chi2_seq``: mean_seq(e^{2 sum r}) - 1;
    - ``log_ppl_diff``: mean over sequences of (mean rollout - mean training log-prob),
      the log of the training / rollout perplexity ratio; ``log_ppl_abs_diff`` its |.|;
    - ``ess_token`` / ``ess_seq``: effective sample size 1 / mean((w / mean w)^2) of the
      token / sequence weights clamped to [lower, upper] (``rollout_is_eff_sample_size``);
    - ``is_clipped_fraction``: tokens whose ratio lies outside [lower, upper];
    - ``rs_masked_fraction``, ``veto_masked_fraction``: tokens the rejection / the veto
      removed; ``veto_seq_fraction``: sequences vetoed.
    """
    n, seqs = max(sums["mm_tokens"], 1.0), max(sums["mm_seqs"], 1.0)

    def ess(w: float, w2: float) -> float:
        return (w * w) / (sums["mm_tokens"] * w2) if w2 > 0 and sums["mm_tokens"] > 0 else 1.0

    return {
        "kl_k1": sums["mm_k1"] / n,
        "kl_k3": sums["mm_k3"] / n,
        "chi2_token": sums["mm_rho2"] / n - 1.0,
        "chi2_seq": sums["mm_seq_rho2"] / seqs - 1.0,
        "log_ppl_diff": sums["mm_log_ppl_diff"] / seqs,
        "log_ppl_abs_diff": sums["mm_log_ppl_abs_diff"] / seqs,
        "ess_token": ess(sums["mm_ess_w"], sums["mm_ess_w2"]),
        "ess_seq": ess(sums["mm_ess_seq_w"], sums["mm_ess_seq_w2"]),
        "is_clipped_fraction": sums["mm_is_clipped"] / n,
        "rs_masked_fraction": sums["mm_rs_masked"] / n,
        "veto_masked_fraction": sums["mm_veto_masked"] / n,
        "veto_seq_fraction": sums["mm_veto_seqs"] / seqs,
    }


def mismatch_diagnostics(logprobs_old: torch.Tensor, logprobs_rollout: torch.Tensor,
                         mask: torch.Tensor, **kwargs) -> dict[str, float]:
    """``mismatch_metrics(mismatch_sums(...))`` of one batch."""
    return mismatch_metrics(mismatch_sums(logprobs_old, logprobs_rollout, mask, **kwargs))
