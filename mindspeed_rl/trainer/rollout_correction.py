"""The trainer's side of rollout correction (verl's keys, ``algorithms/rollout_correction.py``)
and of staleness counted in weight versions.

- ``rollout_is_batch_mean``: the mean of the mini-batch's IS weights over every DP rank,
  which ``rollout_is_batch_normalize`` divides them by (the loss sees one micro-batch).
- ``version_lag``: how many optimizer steps (weight versions) each trained token's weights
  lag the ones the update trains, its metrics, and the bound ``max_weight_version_lag``.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import rollout_correction as rc_fn
from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.trainer.reductions import counts_in_train_layout, global_sums


def _padded(cells: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([c.float() for c in cells], batch_first=True)


def rollout_is_batch_mean(rl, rows: RowBatch) -> float | None:
    """The mean truncated IS weight of this mini-batch over all DP ranks (tokens for
    ``rollout_is: token``, sequences for ``sequence``), or None when not normalising.
    Collective: every rank calls it."""
    if getattr(rl, "rollout_is", None) is None or not rl.rollout_is_batch_normalize:
        return None
    rc = rc_fn.RolloutCorrection.from_rl(rl)
    total = count = 0.0
    if len(rows) and counts_in_train_layout():
        old = _padded(rows.extras["logprobs_old"])
        rollout = _padded(rows.extras["logprobs_rollout"])
        if "response_mask" in rows.extras:
            mask = _padded(rows.extras["response_mask"])
        else:
            mask = _padded([torch.ones(len(r)) for r in rows.responses])
        weights = rc_fn.rollout_is_weights(old, rollout, mask, rc.is_level, rc.is_threshold,
                                           rc.is_threshold_lower)
        total, count = rc_fn.is_weight_mean_sums(weights, mask, rc.is_level)
    total, count = global_sums([total, count])
    return total / count if count > 0 else None
