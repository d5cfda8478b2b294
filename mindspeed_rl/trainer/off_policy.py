"""The trainer's side of off-policy rows: rollout correction (verl's keys,
``algorithms/rollout_correction.py``), staleness counted in weight versions, and the tokens
a partial rollout's older weights generated.

- ``rollout_is_batch_mean``: the mean of the mini-batch's IS weights over every DP rank,
  which ``rollout_is_batch_normalize`` divides them by (the loss sees one micro-batch).
- ``version_lag``: how many optimizer steps (weight versions) each trained token's weights
  lag the ones the update trains, its metrics, and the bound ``max_weight_version_lag``.
- ``mark_off_policy``: a partial rollout's rows as the update reads them (which tokens an
  older policy generated), with the age bound checked.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import rollout_correction as rc_fn
from mindspeed_rl.engine.micro_batches import RowBatch
from mindspeed_rl.trainer.flow import pad_cells
from mindspeed_rl.trainer.reductions import counts_in_train_layout, global_sums


def rollout_is_batch_mean(rl, rows: RowBatch) -> float | None:
    """The mean truncated IS weight of this mini-batch over all DP ranks (tokens for
    ``rollout_is: token``, sequences for ``sequence``), or None when not normalising.
    Collective: every rank calls it."""
    if getattr(rl, "rollout_is", None) is None or not rl.rollout_is_batch_normalize:
        return None
    rc = rc_fn.RolloutCorrection.from_rl(rl)
    total = count = 0.0
    if len(rows) and counts_in_train_layout():
        old = pad_cells(rows.extras["logprobs_old"])[1]
        rollout = pad_cells(rows.extras["logprobs_rollout"])[1]
        if "response_mask" in rows.extras:
            mask = pad_cells(rows.extras["response_mask"])[1]
        else:
            mask = pad_cells([torch.ones(len(r)) for r in rows.responses])[1]
        weights = rc_fn.rollout_is_weights(old, rollout, mask, rc.is_level, rc.is_threshold,
                                           rc.is_threshold_lower)
        total, count = rc_fn.is_weight_mean_sums(weights, mask, rc.is_level)
    total, count = global_sums([total, count])
    return total / count if count > 0 else None


def version_lag(rl, rows: RowBatch, current: int) -> dict[str, float]:
    """Staleness of one mini-batch in weight versions (optimizer steps): each response
    token's lag is ``current`` (the version this optimizer step trains) minus the version
    that generated it (``token_versions`` of a partial rollout, else its row's
    ``weight_version``). Returns this rank's sums and maxima (``staleness_sums``).

    With ``max_weight_version_lag`` = B set, tokens lagging more than B versions leave the
    loss (the rows' ``response_mask`` becomes 0 there), as AReaL's
    ``max_head_offpolicyness`` keeps them out of training; they are counted."""
    lags = []
    for i, response in enumerate(rows.responses):
        if "token_versions" in rows.extras:
            versions = rows.extras["token_versions"][i].to(torch.int64)
        else:
            versions = torch.full((len(response),), int(rows.extras["weight_version"][i]))
        lags.append(current - versions)
    out = {"tokens": float(sum(len(x) for x in lags)), "rows": float(len(lags)),
           "token_lag": float(sum(x.sum() for x in lags)),
           "row_lag": float(sum(x.max() for x in lags if len(x))),
           "max_lag": float(max((int(x.max()) for x in lags if len(x)), default=0)),
           "over_bound": 0.0}
    bound = getattr(rl, "max_weight_version_lag", None)
    if bound is not None:
        over = [(x > bound).float() for x in lags]
        out["over_bound"] = float(sum(o.sum() for o in over))
        if out["over_bound"]:
            masks = rows.extras.get("response_mask") or [torch.ones(len(x)) for x in lags]
            rows.extras["response_mask"] = [m.float() * (1.0 - o) for m, o in zip(masks, over)]
    return out


def mark_off_policy(rows: RowBatch, proximal: int, iteration: int, max_split: int) -> None:
    """Replace the rows' token versions by their ``off_policy`` mask (1 where weights other
    than the ``proximal`` version generated the token) and check the age bound: no row is
    trained more than ``max_split - 1`` iterations after its first token."""
    versions = rows.extras.pop("token_versions")
    rows.extras["off_policy"] = [(v != proximal).float() for v in versions]
    births = rows.extras.pop("birth_iteration")
    bound = max_split - 1
    too_old = [int(b) for b in births if iteration - int(b) > bound]
    if too_old:
        raise RuntimeError(f"partial rollout: a row born in iteration {too_old[0]} reached "
                           f"the update of iteration {iteration}, older than "
                           f"partial_rollout_max_split - 1 = {bound} iterations")


def staleness_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """``staleness/*`` over the optimizer steps of an iteration and every DP rank: the mean
    lag per token and per row (a row's oldest token), the largest, and the fraction of
    tokens the bound kept out of the loss. Collective."""
    keys = ("tokens", "rows", "token_lag", "row_lag", "over_bound")
    counted = counts_in_train_layout()
    sums = global_sums([sum(s[k] for s in steps) if counted else 0.0 for k in keys])
    total = dict(zip(keys, sums))
    t = torch.tensor([max((s["max_lag"] for s in steps), default=0.0)], dtype=torch.float64)
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    tokens, nrows = max(total["tokens"], 1.0), max(total["rows"], 1.0)
    return {"staleness/version_lag_token_mean": total["token_lag"] / tokens,
            "staleness/version_lag_row_mean": total["row_lag"] / nrows,
            "staleness/version_lag_max": t.item(),
            "staleness/over_bound_token_fraction": total["over_bound"] / tokens}
