"""REINFORCE++ and REINFORCE++-baseline against verl's definitions on fixed tensors.

The references restate verl's ``compute_reinforce_plus_plus_outcome_advantage`` (a
reversed running return reset after each masked position, then ``masked_whiten``) and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (score minus its prompt's mean,
tiled over the response, then ``masked_whiten``), with verl's ``masked_whiten``: mean and
unbiased variance over the masked tokens (1e-8 added to the counts), rsqrt(var + 1e-8).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.advantages import whiten
from mindspeed_rl.algorithms.masked import moments_from_sums
from mindspeed_rl.algorithms.reinforce_plus_plus import (discounted_returns,
                                                         group_mean_baseline,
                                                         reinforce_plus_plus_advantages)


def _verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum()
    mean = (values * mask).sum() / (count + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (count + 1e-8) * count / (count - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


# 3 right-padded responses of lengths 4, 2, 3: a score on the last token, a small
# per-token KL penalty on every token (what use_kl_in_reward puts in).
MASK = torch.tensor([[1., 1., 1., 1.], [1., 1., 0., 0.], [1., 1., 1., 0.]])
REWARDS = torch.tensor([[-0.01, 0.02, -0.03, 1.0], [0.01, -0.2, 0., 0.],
                        [0.0, -0.02, 1.19, 0.]]) * MASK


def test_discounted_returns_match_verl():
    for gamma in (1.0, 0.9):
        torch.testing.assert_close(discounted_returns(REWARDS, MASK, gamma),
                                   _verl_returns(REWARDS, MASK, gamma) * MASK, rtol=0, atol=1e-6)
    # by hand, gamma 0.5, first row: 1.0; -0.03 + 0.5; 0.02 + 0.5 * 0.47; -0.01 + 0.5 * 0.255
    got = discounted_returns(REWARDS, MASK, 0.5)[0]
    torch.testing.assert_close(got, torch.tensor([0.1175, 0.255, 0.47, 1.0]), rtol=0, atol=1e-6)


def test_reinforce_plus_plus_matches_verl():
    want = _verl_masked_whiten(_verl_returns(REWARDS, MASK, 0.9), MASK) * MASK
    torch.testing.assert_close(reinforce_plus_plus_advantages(REWARDS, MASK, 0.9), want,
                               rtol=0, atol=1e-5)


def test_the_phase_whitening_over_ranks_is_masked_whiten():
    """The phase sums per rank and whitens with moments_from_sums: split the batch in two
    'ranks' and get verl's one-batch answer."""
    returns = discounted_returns(REWARDS, MASK, 0.9)
    parts = [(returns[:2], MASK[:2]), (returns[2:], MASK[2:])]
    sums = [sum(float((r * m).sum()) for r, m in parts),
            sum(float((r.square() * m).sum()) for r, m in parts),
            sum(float(m.sum()) for _, m in parts)]
    mean, var = moments_from_sums(*sums)
    got = torch.cat([whiten(r, m, mean, var) for r, m in parts])
    want = _verl_masked_whiten(_verl_returns(REWARDS, MASK, 0.9), MASK) * MASK
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_reinforce_plus_plus_baseline_matches_verl():
    scores = torch.tensor([[1.0, 0.0, 1.2], [0.2, 0.2, 0.2], [-1.0, 0.5, 2.0]])  # [groups, n]
    lengths = torch.tensor([4, 2, 3, 1, 4, 2, 3, 3, 1])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).float()  # [9, 4]
    centred = group_mean_baseline(scores)
    torch.testing.assert_close(centred[0], torch.tensor([1.0, 0.0, 1.2]) - 2.2 / 3,
                               rtol=0, atol=1e-6)
    tiled = centred.reshape(-1, 1) * mask
    mean, var = moments_from_sums(float(tiled.sum()), float(tiled.square().sum()),
                                  float(mask.sum()))
    got = whiten(tiled, mask, mean, var)
    # verl: per prompt index, score minus the group mean (a group of one: minus 0)
    flat, index = scores.reshape(-1), [g for g in range(3) for _ in range(3)]
    means = {g: flat[[i for i, j in enumerate(index) if j == g]].mean() for g in range(3)}
    verl_scores = torch.stack([flat[i] - means[index[i]] for i in range(9)])
    want = _verl_masked_whiten(verl_scores[:, None] * mask, mask) * mask
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    single = torch.tensor([[0.4], [-1.0]])
    torch.testing.assert_close(group_mean_baseline(single), single)


def test_a_masked_token_inside_a_response_passes_the_return_through():
    """Where this differs from verl on purpose (docs/algorithms.md): a multi-turn tool
    token (mask 0 inside the response) does not cut the model's earlier tokens off the
    final reward."""
    mask = torch.tensor([[1., 0., 1.]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5),
                               torch.tensor([[0.5, 0.0, 1.0]]))
    assert _verl_returns(rewards, mask, 0.5)[0, 0].item() == 0.0  # verl resets there


def test_the_phase_puts_the_kl_to_the_reference_into_the_per_token_reward():
    """discounted_returns' and gae's per-token reward (trainer/phases.py): the score on the
    last token minus beta x KL(old || ref) on every token, from the rows' log-prob cells."""
    from types import SimpleNamespace

    from mindspeed_rl.algorithms.kl import kl_penalty
    from mindspeed_rl.trainer.phases import _padded, _token_rewards

    old = [torch.tensor([-0.5, -1.0, -0.2]), torch.tensor([-0.3])]
    ref = [torch.tensor([-0.7, -0.9, -0.2]), torch.tensor([-1.3])]
    batch = {"rewards": [torch.tensor(1.0), torch.tensor(0.5)], "logprobs_old": old,
             "logprobs_ref": ref}
    ctx = SimpleNamespace(rl=SimpleNamespace(kl_penalty="low_var_kl"),
                          state=SimpleNamespace(kl_ctrl=SimpleNamespace(value=0.1)))
    mask, _ = _padded(old)
    rewards, kl, beta = _token_rewards(ctx, batch, mask, kl_in_reward=True)
    want_kl = kl_penalty(_padded(old)[1], _padded(ref)[1], "low_var_kl") * mask
    assert beta == 0.1 and kl.abs().sum() > 0.1
    torch.testing.assert_close(kl, want_kl)
    torch.testing.assert_close(rewards, torch.tensor([[0., 0., 1.], [0.5, 0., 0.]])
                               - 0.1 * want_kl)
