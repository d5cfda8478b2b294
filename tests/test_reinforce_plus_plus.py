"""REINFORCE++ and REINFORCE++-baseline against verl's definitions on fixed tensors.

The references restate verl's ``compute_reinforce_plus_plus_outcome_advantage`` (a
reversed running return reset after each masked position, then ``masked_whiten``) and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` (score minus its prompt's mean,
tiled over the response, then ``masked_whiten``), with verl's ``masked_whiten``: mean and
unbiased variance over the masked tokens (1e-8 added to the counts), rsqrt(var + 1e-8).
The estimators are called as the trainer calls them (``AdvantageInputs`` and the sums).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms.advantages import gae_advantages
from mindspeed_rl.algorithms.estimator import AdvantageInputs, local_sums
from mindspeed_rl.algorithms.masked import whiten_over_ranks
from mindspeed_rl.algorithms.reinforce_plus_plus import group_mean_baseline


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


def _inputs(rewards_per_token: torch.Tensor, mask: torch.Tensor) -> AdvantageInputs:
    """Inputs whose per-token reward (score on the last token - kl_coef x KL) is
    ``rewards_per_token``: the score is its last token's, the KL the negated rest."""
    last = mask.sum(dim=1).long() - 1
    scores = rewards_per_token[torch.arange(len(mask)), last]
    kl = -rewards_per_token.clone()
    kl[torch.arange(len(mask)), last] = 0.0
    return AdvantageInputs(rewards=scores, response_mask=mask, loss_mask=mask, kl=kl, kl_coef=1.0)


def _two_ranks(parts) -> list[float]:
    """The sums each of two 'ranks' holding ``parts`` would receive for whitening."""
    local = []
    for x, m in parts:
        whiten_over_ranks(x, m, lambda v: local.append(v) or v)
    return [sum(column) for column in zip(*local)]


def test_discounted_returns_are_gae_without_critic_and_match_verl():
    zeros = torch.zeros_like(REWARDS)
    for gamma in (1.0, 0.9):
        returns, _ = gae_advantages(REWARDS, zeros, MASK, gamma, 1.0)
        torch.testing.assert_close(returns, _verl_returns(REWARDS, MASK, gamma) * MASK,
                                   rtol=0, atol=1e-6)
    # by hand, gamma 0.5, first row: 1.0; -0.03 + 0.5; 0.02 + 0.5 * 0.47; -0.01 + 0.5 * 0.255
    got = gae_advantages(REWARDS, zeros, MASK, 0.5, 1.0)[0][0]
    torch.testing.assert_close(got, torch.tensor([0.1175, 0.255, 0.47, 1.0]), rtol=0, atol=1e-6)


def test_reinforce_plus_plus_matches_verl():
    est = registry.estimator("reinforce_plus_plus")
    out = est.fn(_inputs(REWARDS, MASK), local_sums, gamma=0.9)
    want = _verl_masked_whiten(_verl_returns(REWARDS, MASK, 0.9), MASK) * MASK
    torch.testing.assert_close(out.advantages, want, rtol=0, atol=1e-5)
    assert out.returns is None and est.kl_in_reward


def test_the_whitening_over_ranks_is_masked_whiten():
    """Split the batch over two 'ranks', each whitening with the sums of both: verl's
    one-batch answer."""
    returns = gae_advantages(REWARDS, torch.zeros_like(REWARDS), MASK, 0.9, 1.0)[0]
    parts = [(returns[:2], MASK[:2]), (returns[2:], MASK[2:])]
    total = _two_ranks(parts)
    got = torch.cat([whiten_over_ranks(r, m, lambda v: total) for r, m in parts])
    want = _verl_masked_whiten(_verl_returns(REWARDS, MASK, 0.9), MASK) * MASK
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_reinforce_plus_plus_baseline_matches_verl():
    scores = torch.tensor([[1.0, 0.0, 1.2], [0.2, 0.2, 0.2], [-1.0, 0.5, 2.0]])  # [groups, n]
    lengths = torch.tensor([4, 2, 3, 1, 4, 2, 3, 3, 1])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).float()  # [9, 4]
    centred = group_mean_baseline(scores)
    torch.testing.assert_close(centred[0], torch.tensor([1.0, 0.0, 1.2]) - 2.2 / 3,
                               rtol=0, atol=1e-6)
    x = AdvantageInputs(rewards=scores.reshape(-1), response_mask=mask, loss_mask=mask,
                        group_size=3)
    got = registry.estimator("reinforce_plus_plus_baseline").fn(x, local_sums).advantages
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
    returns, _ = gae_advantages(rewards, torch.zeros_like(rewards), mask, 0.5, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.0, 1.0]]))
    assert _verl_returns(rewards, mask, 0.5)[0, 0].item() == 0.0  # verl resets there


def test_the_kl_to_the_reference_enters_the_per_token_reward():
    """The estimators that take the KL into their reward subtract kl_coef x KL on every
    token and put the score on the last one; the phase gives them KL(old || ref) of the
    rows' log-prob cells (``trainer/phases.py``)."""
    from types import SimpleNamespace

    from mindspeed_rl.algorithms.kl import kl_penalty
    from mindspeed_rl.trainer.flow import pad_cells
    from mindspeed_rl.trainer.phases import _advantage_inputs

    old = [torch.tensor([-0.5, -1.0, -0.2]), torch.tensor([-0.3])]
    ref = [torch.tensor([-0.7, -0.9, -0.2]), torch.tensor([-1.3])]
    batch = _Batch({"rewards": [torch.tensor(1.0), torch.tensor(0.5)], "logprobs_old": old,
                    "logprobs_ref": ref, "response_ids": [torch.zeros(3), torch.zeros(1)]})
    ctx = SimpleNamespace(rl=SimpleNamespace(kl_penalty="low_var_kl", n_samples_per_prompt=1),
                          state=SimpleNamespace(kl_ctrl=SimpleNamespace(value=0.1)))
    x = _advantage_inputs(ctx, batch, torch.arange(2), kl_in_reward=True)
    mask = pad_cells(old)[0]
    want_kl = kl_penalty(pad_cells(old)[1], pad_cells(ref)[1], "low_var_kl") * mask
    assert x.kl_coef == 0.1 and x.kl.abs().sum() > 0.1
    torch.testing.assert_close(x.kl, want_kl)
    token_rewards = torch.tensor([[0., 0., 1.], [0.5, 0., 0.]]) - 0.1 * want_kl
    out = registry.estimator("reinforce_plus_plus").fn(x, local_sums, gamma=1.0)
    returns = gae_advantages(token_rewards, torch.zeros_like(mask), mask, 1.0, 1.0)[0]
    torch.testing.assert_close(out.advantages, _verl_masked_whiten(returns, mask) * mask,
                               rtol=0, atol=1e-5)


class _Batch(dict):
    """A dock batch's reading interface (columns by name)."""

    @property
    def columns(self):
        return list(self)

    def __len__(self):
        return len(self["rewards"])
