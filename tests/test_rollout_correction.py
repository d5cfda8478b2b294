"""Rollout correction (mindspeed_rl/algorithms/rollout_correction.py) against the values
verl's rollout-correction tests expect on their own example (two sequences of five
tokens, training log-prob -2 everywhere, rollout -1 for the first, -2.5 for the second:
per-token ratios e^-1 ~ 0.368 and e^0.5 ~ 1.649)."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_rl.algorithms.rollout_correction import (
    RolloutCorrection, correct, is_weight_mean_sums, mismatch_diagnostics, mismatch_metrics,
    mismatch_sums, normalize_weights, rejection_mask, rollout_is_weights, veto_mask)

OLD = torch.full((2, 5), -2.0)
ROLLOUT = torch.tensor([[-1.0] * 5, [-2.5] * 5])
MASK = torch.ones(2, 5)


def test_token_is_weights_equal_verls():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "token", threshold=2.0)
    assert torch.allclose(w[0], torch.full((5,), 0.3679), atol=1e-4)
    assert torch.allclose(w[1], torch.full((5,), 1.6487), atol=1e-4)
    assert not w.requires_grad
    # truncation above, and below when a lower threshold is given
    assert rollout_is_weights(OLD, ROLLOUT, MASK, "token", threshold=1.5)[1, 0] == 1.5
    assert rollout_is_weights(OLD, ROLLOUT, MASK, "token", 2.0, threshold_lower=0.5)[0, 0] == 0.5
    # padding weighs 0
    mask = MASK.clone()
    mask[0, 3:] = 0
    assert rollout_is_weights(OLD, ROLLOUT, mask, "token")[0, 3:].abs().sum() == 0


def test_sequence_is_weights_equal_verls():
    """Product of the token ratios, truncated: [e^-5 = 0.0067, min(e^2.5, 2) = 2.0]."""
    w = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence", threshold=2.0)
    assert torch.allclose(w[0], torch.full((5,), 0.0067379), atol=1e-6)
    assert torch.equal(w[1], torch.full((5,), 2.0))
    # the padding of a shorter row neither counts in the product nor gets a weight
    mask = MASK.clone()
    mask[0, 2:] = 0
    short = rollout_is_weights(OLD, ROLLOUT, mask, "sequence", threshold=2.0)
    assert torch.allclose(short[0, :2], torch.full((2,), math.exp(-2.0)))
    assert short[0, 2:].abs().sum() == 0


def test_batch_normalisation_to_mean_one():
    tok = rollout_is_weights(OLD, ROLLOUT, MASK, "token")
    norm = normalize_weights(tok, *is_weight_mean_sums(tok, MASK, "token"))
    assert torch.allclose(norm[:, 0], torch.tensor([0.364851, 1.635149]), atol=1e-5)
    assert abs(float(norm.mean()) - 1.0) < 1e-6
    seq = rollout_is_weights(OLD, ROLLOUT, MASK, "sequence")
    total, count = is_weight_mean_sums(seq, MASK, "sequence")
    assert count == 2  # one weight per sequence, not per token
    seq_norm = normalize_weights(seq, total, count)
    assert torch.allclose(seq_norm[:, 0], torch.tensor([0.0067153, 1.9932847]), atol=1e-6)


@pytest.mark.parametrize("level, lower, upper, expected", [
    ("token", 0.5, 2.0, [0.0, 1.0]),       # verl's mask-mode example (IcePop's band)
    ("geometric", 0.5, 2.0, [0.0, 1.0]),   # geometric-mean ratios 0.368 / 1.649
    ("sequence", 0.5, 2.0, [0.0, 0.0]),    # products 0.0067 / 12.2: both outside
    ("sequence", 1e-3, 20.0, [1.0, 1.0]),
    ("geometric", None, 1.5, [0.0, 0.0]),  # lower defaults to 1 / upper = 0.667
    ("geometric", None, 3.0, [1.0, 1.0]),
])
def test_rejection_masks_equal_verls(level, lower, upper, expected):
    keep = rejection_mask(OLD, ROLLOUT, MASK, level, upper, lower)
    assert keep[:, 0].tolist() == expected
    assert torch.equal(keep, keep[:, :1].expand_as(keep))  # whole rows here
    if level == "token" and lower == 0.5:
        assert float(1 - keep.mean()) == 0.5  # verl: half the tokens masked


def test_token_rejection_is_per_token():
    rollout = ROLLOUT.clone()
    rollout[1, 2] = 0.0  # one token of row 1 with ratio e^-2
    keep = rejection_mask(OLD, rollout, MASK, "token", 2.0, 0.5)
    assert keep[1].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_veto_rejects_the_whole_sequence():
    """verl's veto example: one token of row 0 at ratio e^-15 ~ 3e-7 < 1e-4."""
    old = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    rollout = old.clone()
    rollout[0, 2] += 15.0
    keep = veto_mask(old, rollout, MASK, 1e-4)
    assert keep[0].sum() == 0 and torch.equal(keep[1], MASK[1])
    metrics = mismatch_diagnostics(old, rollout, MASK, keep_veto=keep)
    assert metrics["veto_seq_fraction"] == 0.5 and metrics["veto_masked_fraction"] == 0.5
    assert veto_mask(old, rollout, MASK, 1e-8).sum() == 10  # above e^-15: nothing vetoed


def test_correct_keeps_weights_and_masks_rejected_tokens():
    """As verl: weights stay the truncated ratios (not zeroed); rejection acts on the mask."""
    rc = RolloutCorrection(is_level="token", is_threshold=2.0, rs_level="token",
                           rs_threshold=2.0, rs_threshold_lower=0.5)
    weights, keep = correct(OLD, ROLLOUT, MASK, rc)
    assert torch.allclose(weights[0, 0], torch.tensor(0.368), atol=0.01)
    assert torch.allclose(weights[1, 0], torch.tensor(1.649), atol=0.01)
    assert keep[0].sum() == 0 and keep[1].sum() == 5
    weights, keep = correct(OLD, ROLLOUT, MASK, RolloutCorrection())
    assert weights is None and torch.equal(keep, MASK)


def test_diagnostics_equal_verls():
    """ESS 0.778, KL k1 0.25 and k3 0.258, chi2 0.427 on verl's example."""
    m = mismatch_diagnostics(OLD, ROLLOUT, MASK, threshold=2.0)
    assert m["ess_token"] == pytest.approx(0.777723, abs=1e-5)
    assert m["kl_k1"] == pytest.approx(0.25, abs=1e-6)
    assert m["kl_k3"] == pytest.approx(0.258300, abs=1e-5)
    assert m["chi2_token"] == pytest.approx(0.426809, abs=1e-5)
    assert m["chi2_seq"] == pytest.approx(73.206602, rel=1e-5)
    assert m["log_ppl_diff"] == pytest.approx(0.25, abs=1e-6)
    assert m["log_ppl_abs_diff"] == pytest.approx(0.75, abs=1e-6)
    # sequence weights clamped to [0.5, 2]: 0.5 and 2.0
    assert m["ess_seq"] == pytest.approx(0.735294, abs=1e-5)
    assert m["is_clipped_fraction"] == pytest.approx(0.5)  # row 0 below 1/2
    same = mismatch_diagnostics(OLD, OLD, MASK)
    assert same["kl_k1"] == 0 and same["chi2_token"] == 0 and same["ess_token"] == 1.0


def test_sums_add_over_micro_batches_and_packing():
    """Two halves summed give the whole batch's diagnostics; two sequences packed along one
    row (segment ids) give the same weights, masks and diagnostics as padded rows."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(2, 5, generator=g) * 3
    rollout = old + torch.randn(2, 5, generator=g) * 0.3
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    whole = mismatch_diagnostics(old, rollout, mask)
    halves = [mismatch_sums(old[i:i + 1], rollout[i:i + 1], mask[i:i + 1]) for i in range(2)]
    summed = mismatch_metrics({k: halves[0][k] + halves[1][k] for k in halves[0]})
    assert summed == pytest.approx(whole)
    packed_old = torch.cat([old[0], old[1, :3]])[None]
    packed_roll = torch.cat([rollout[0], rollout[1, :3]])[None]
    packed_mask = torch.ones(1, 8)
    seg = torch.tensor([[0] * 5 + [1] * 3])
    assert mismatch_diagnostics(packed_old, packed_roll, packed_mask,
                                segment_ids=seg) == pytest.approx(whole)
    for level in ("sequence",):
        padded = rollout_is_weights(old, rollout, mask, level)
        packed = rollout_is_weights(packed_old, packed_roll, packed_mask, level, segment_ids=seg)
        assert torch.allclose(packed[0], torch.cat([padded[0], padded[1, :3]]))
    for level in ("sequence", "geometric"):
        padded = rejection_mask(old, rollout, mask, level, 1.2)
        packed = rejection_mask(packed_old, packed_roll, packed_mask, level, 1.2, segment_ids=seg)
        assert torch.equal(packed[0], torch.cat([padded[0], padded[1, :3]]))


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="rollout_is_threshold_lower"):
        rollout_is_weights(OLD, ROLLOUT, MASK, "token", 2.0, threshold_lower=2.0)
    with pytest.raises(ValueError, match="rollout_rs_threshold_lower"):
        rejection_mask(OLD, ROLLOUT, MASK, "token", 2.0, 3.0)
    with pytest.raises(ValueError, match="rollout_is="):
        rollout_is_weights(OLD, ROLLOUT, MASK, "geometric")


def test_version_lag_counts_versions_and_enforces_the_bound():
    """Lag = the trained version minus each token's generating version (partial rollout's
    token_versions, else the row's weight_version); the bound masks the older tokens."""
    from types import SimpleNamespace

    from mindspeed_rl.engine.micro_batches import RowBatch
    from mindspeed_rl.trainer.off_policy import version_lag

    def rows(**extras):
        return RowBatch([torch.ones(2)] * 2, [torch.ones(4), torch.ones(2)], extras)

    partial = rows(token_versions=[torch.tensor([1, 1, 3, 4]), torch.tensor([4, 4])])
    out = version_lag(SimpleNamespace(max_weight_version_lag=None), partial, 5)
    assert (out["token_lag"], out["tokens"]) == (4 + 4 + 2 + 1 + 1 + 1, 6)
    assert (out["row_lag"], out["max_lag"], out["over_bound"]) == (4 + 1, 4, 0)
    assert "response_mask" not in partial.extras
    out = version_lag(SimpleNamespace(max_weight_version_lag=2), partial, 5)
    assert out["over_bound"] == 2
    assert partial.extras["response_mask"][0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert partial.extras["response_mask"][1].tolist() == [1.0, 1.0]
    # a multi-turn loss mask stays 0 where it was
    turns = rows(weight_version=[torch.tensor(2), torch.tensor(5)],
                 response_mask=[torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(2)])
    out = version_lag(SimpleNamespace(max_weight_version_lag=1), turns, 5)
    assert (out["token_lag"], out["max_lag"], out["over_bound"]) == (12, 3, 4)
    kept = turns.extras["response_mask"]
    assert kept[0].sum() == 0 and kept[1].sum() == 2
