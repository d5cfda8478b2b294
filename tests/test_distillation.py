"""On-policy distillation's per-token reverse-KL advantage on fixed tensors: the definition,
the loss through the clipped policy loss under every loss_agg_mode, the mixing with the task
reward, the metrics. Pure tensors, no process group.

The definition restated here: A_t = -(log pi_s(y_t) - log pi_t(y_t)) + c * r on the tokens
of the loss mask, 0 elsewhere; its expectation over the student's own samples is minus the
reverse KL, KL(pi_s || pi_t) (not the forward KL(pi_t || pi_s)).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mindspeed_rl.algorithms import LOSS_AGG_MODES, policy_loss, registry
from mindspeed_rl.algorithms.estimator import AdvantageInputs, local_sums
from mindspeed_rl.algorithms.distillation import (distillation_advantages,
                                                  distillation_metrics, distillation_sums)

# Two responses of 4 tokens; row 0 has a tool response at position 2 (mask 0), row 1 is
# 3 tokens long (position 3 is padding).
LP_S = torch.tensor([[-0.5, -1.0, -2.0, -0.1], [-3.0, -0.2, -0.7, -9.0]])
LP_T = torch.tensor([[-1.5, -0.25, -0.5, -0.1], [-1.0, -0.2, -2.7, -4.0]])
MASK = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
# by hand: -(s - t) on the mask, 0 off it
WANT = torch.tensor([[-1.0, 0.75, 0.0, 0.0], [2.0, 0.0, -2.0, 0.0]])


def test_the_advantage_is_minus_the_per_token_reverse_kl_on_the_mask():
    adv = distillation_advantages(LP_S, LP_T, MASK)
    torch.testing.assert_close(adv, WANT, rtol=0, atol=1e-7)
    # detached: no gradient flows through the advantage into the student
    student = LP_S.clone().requires_grad_(True)
    assert not distillation_advantages(student, LP_T, MASK).requires_grad
    # the registered estimator computes it on the trained tokens (its one call signature)
    est = registry.estimator("on_policy_distill")
    x = AdvantageInputs(rewards=torch.tensor([1.0, -0.5]), response_mask=torch.ones(2, 4),
                        loss_mask=MASK.float(), logprobs_old=LP_S, logprobs_teacher=LP_T)
    out = est.fn(x, local_sums, **est.kwargs(SimpleNamespace(
        teacher_config=SimpleNamespace(task_reward_coef=0.0))))
    torch.testing.assert_close(out.advantages, WANT, rtol=0, atol=1e-7)
    assert out.metrics["distill/reverse_kl"] == pytest.approx(-float(WANT.sum()) / 6)  # 6 tokens


def test_its_expectation_over_the_students_samples_is_minus_the_reverse_kl():
    """Every token of a small vocabulary, weighted by the student's probability: the mean
    advantage is -KL(pi_s || pi_t), which differs from -KL(pi_t || pi_s) here."""
    g = torch.Generator().manual_seed(0)
    logits_s, logits_t = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g) * 2
    lp_s, lp_t = logits_s.log_softmax(-1), logits_t.log_softmax(-1)
    adv = distillation_advantages(lp_s, lp_t, torch.ones_like(lp_s))  # one "token" per vocab id
    expected_adv = (lp_s.exp() * adv).sum(-1)
    reverse = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=logits_s),
                                                torch.distributions.Categorical(logits=logits_t))
    forward = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=logits_t),
                                                torch.distributions.Categorical(logits=logits_s))
    torch.testing.assert_close(expected_adv, -reverse, rtol=0, atol=1e-5)
    assert (expected_adv + forward).abs().min() > 0.1


def test_the_task_reward_mixes_in_by_its_coefficient():
    rewards = torch.tensor([1.0, -0.5])
    mixed = distillation_advantages(LP_S, LP_T, MASK, rewards, task_reward_coef=0.2)
    torch.testing.assert_close(mixed, WANT + 0.2 * rewards[:, None] * MASK, rtol=0, atol=1e-7)
    torch.testing.assert_close(distillation_advantages(LP_S, LP_T, MASK, rewards, 0.0), WANT)
    with pytest.raises(ValueError, match="needs the sequence rewards"):
        distillation_advantages(LP_S, LP_T, MASK, None, task_reward_coef=0.5)


def _by_definition(mode: str, per_token: torch.Tensor, mask: torch.Tensor,
                   norm_length: float) -> torch.Tensor:
    m = mask.float()
    if mode == "token-mean":
        return (per_token * m).sum() / m.sum()
    seq = (per_token * m).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / m.sum(-1)
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / norm_length
    return seq.mean()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_the_clipped_policy_loss_is_the_reverse_kl_and_its_gradient(mode):
    """On-policy (ratio 1) the clipped loss is the aggregated per-token reverse KL, and its
    gradient in each student log-prob is that token's log-ratio (over the normaliser)."""
    student = LP_S.clone().requires_grad_(True)
    adv = distillation_advantages(student, LP_T, MASK)
    loss, stats = policy_loss(student, LP_S, adv, MASK, 0.2, 0.2, loss_agg_mode=mode,
                              norm_length=8.0)
    kl = LP_S - LP_T
    torch.testing.assert_close(loss, _by_definition(mode, kl, MASK, 8.0), rtol=0, atol=1e-6)
    loss.backward()
    m = MASK.float()
    if mode == "token-mean":
        scale = 1.0 / m.sum()
    elif mode == "seq-mean-token-mean":
        scale = 1.0 / (m.sum(-1, keepdim=True) * 2)
    elif mode == "seq-mean-token-sum-norm":
        scale = torch.tensor(1.0 / (8.0 * 2))
    else:
        scale = torch.tensor(1.0 / 2)
    torch.testing.assert_close(student.grad, kl * m * scale, rtol=0, atol=1e-6)
    assert stats["pg_clipfrac"] == 0


def test_the_metrics_sum_over_tokens_and_position_buckets():
    sums = distillation_sums(LP_S, LP_T, MASK, buckets=(0, 2))
    metrics = distillation_metrics(sums)
    kl = (LP_S - LP_T) * MASK
    assert metrics["distill/reverse_kl"] == pytest.approx(float(kl.sum()) / 6)
    assert metrics["distill/reverse_kl_per_sequence"] == pytest.approx(float(kl.sum()) / 2)
    assert metrics["distill/student_logprob"] == pytest.approx(float((LP_S * MASK).sum()) / 6)
    assert metrics["distill/teacher_logprob"] == pytest.approx(float((LP_T * MASK).sum()) / 6)
    # positions 0-1: four tokens; positions 2+: two tokens (row 0's tool token is out)
    assert metrics["distill/reverse_kl_pos_0_2"] == pytest.approx(float(kl[:, :2].sum()) / 4)
    assert metrics["distill/reverse_kl_pos_2_up"] == pytest.approx(float(kl[:, 2:].sum()) / 2)
    assert "distill/reverse_kl_pos_0_2" in distillation_metrics(
        distillation_sums(LP_S[:, :1], LP_T[:, :1], MASK[:, :1], buckets=(0, 2)))
    assert "distill/reverse_kl_pos_2_up" not in distillation_metrics(
        distillation_sums(LP_S[:, :1], LP_T[:, :1], MASK[:, :1], buckets=(0, 2)))
