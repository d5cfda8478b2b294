"""Masked reductions over response tokens.

Every tensor here is right-padded ``[batch, resp_len]``; ``mask`` is the
response mask (1 for a generated token, 0 for padding), bool or float. These are
local reductions: statistics over several data-parallel ranks are formed by the
caller from sums and counts (see ``agg_loss``'s ``num_tokens_global``).
"""

from __future__ import annotations

from typing import Callable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) over ``dim`` (all elements when None)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over ``dim`` (all elements when None).

    An empty mask gives 0, not NaN: a micro-batch of padding must not poison the
    metrics or the loss.
    """
    mask = mask.to(x.dtype)
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of ``x`` (a scalar).

    var = sum(mask * (x - mean)^2) / (N - 1) with N = sum(mask) (``unbiased``),
    or / N otherwise.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    count = mask.sum()
    sum_sq = masked_sum((x - mean) ** 2, mask)
    if unbiased:
        return sum_sq / (count - 1).clamp(min=1.0)
    return sum_sq / count.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements (PPO advantage whitening).

    With ``shift_mean=False`` the mean is added back (only the scale changes), as
    verl/TRL do for rewards. Padding positions come back as 0.
    """
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def moments_from_sums(total: float, total_sq: float, count: float) -> tuple[float, float]:
    """(mean, unbiased variance) of ``count`` elements from their sum and sum of squares:
    the statistics of a batch split over ranks, each contributing its sums."""
    mean = total / max(count, 1.0)
    return mean, (total_sq / max(count, 1.0) - mean ** 2) * count / max(count - 1.0, 1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, mean: float, var: float,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on the masked elements, 0 elsewhere, with the
    statistics given (e.g. over every DP rank's tokens, reduced by the caller)."""
    return (x - mean) * (var + eps) ** -0.5 * mask.to(x.dtype)


def whiten_over_ranks(x: torch.Tensor, mask: torch.Tensor,
                      sums: Callable[[list[float]], list[float]]) -> torch.Tensor:
    """``masked_whiten`` over the masked elements of every rank: ``sums`` adds this
    rank's [sum, sum of squares, count] over the ranks (the identity for one rank, where
    this equals ``masked_whiten`` up to rounding). [batch, resp_len] -> [batch, resp_len]"""
    mask_f = mask.float()
    mean, var = moments_from_sums(*sums([float((x * mask_f).sum()),
                                         float((x.square() * mask_f).sum()),
                                         float(mask_f.sum())]))
    return whiten(x, mask_f, mean, var)
