"""Per-token KL estimators between the policy and the reference model.

Schulman's estimators (http://joschu.net/blog/kl-approx.html) of KL(pi || pi_ref)
from samples of pi, with log-ratio x = logp - logp_ref:

- ``k1`` (MindSpeed-RL / verl name ``kl``): x   (unbiased, high variance, can be < 0)
- ``abs``: |x|                                   (MindSpeed-RL's, biased)
- ``k2`` (MindSpeed-RL name ``mse``): 0.5 * x^2  (biased, low variance)
- ``low_var_kl`` (alias ``k3``): exp(-x) + x - 1 = exp(ref - logp) - (ref - logp) - 1
  (unbiased and always >= 0). As in verl, ref - logp is clamped to [-20, 20] before
  the exp and the result to [-10, 10], so one badly off-policy token cannot
  produce an inf or dominate the loss.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "low_var_kl", "k3")


def kl_penalty(logprobs: torch.Tensor, logprobs_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference.

    logprobs: log-probs of the sampled tokens under the current (or old) policy,
    logprobs_ref: under the reference model; both [batch, resp_len].
    kind: one of ``KL_ESTIMATORS`` (see the module docstring for the formulas).
    returns: [batch, resp_len] (not masked; aggregate with ``agg_loss``/``masked_mean``).
    """
    log_ratio = logprobs - logprobs_ref  # [batch, resp_len]
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    if kind in ("low_var_kl", "k3"):
        ref_minus_logp = torch.clamp(-log_ratio, min=-20.0, max=20.0)
        kld = torch.exp(ref_minus_logp) - ref_minus_logp - 1.0
        return torch.clamp(kld, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid ones are {list(KL_ESTIMATORS)} "
                     "(rl_config.kl_penalty)")
