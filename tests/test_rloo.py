"""RLOO's leave-one-out advantages against verl's definition on fixed tensors.

The reference below restates verl's ``compute_rloo_outcome_advantage`` (group the
sequence scores by prompt index; a group of one keeps its score; otherwise
A_i = r_i * n / (n - 1) - mean_g * n / (n - 1)), written independently of the module.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.rloo import rloo_advantages


def _verl_rloo(scores: list[float], index: list[int]) -> list[float]:
    groups: dict[int, list[float]] = {}
    for s, i in zip(scores, index):
        groups.setdefault(i, []).append(s)
    out = []
    for s, i in zip(scores, index):
        n = len(groups[i])
        mean = sum(groups[i]) / n
        out.append(s if n == 1 else s * n / (n - 1) - mean * n / (n - 1))
    return out


SCORES = torch.tensor([[1.0, 0.0, 0.0, 1.2], [0.2, 0.2, 0.2, 0.2], [-1.0, 0.5, 2.0, 0.0]])


def test_rloo_matches_verl_on_fixed_groups():
    got = rloo_advantages(SCORES)
    index = [g for g in range(3) for _ in range(4)]
    want = torch.tensor(_verl_rloo(SCORES.reshape(-1).tolist(), index)).view(3, 4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # by hand: 1.0 - (0 + 0 + 1.2) / 3 = 0.6; a group without spread gets 0
    assert abs(got[0, 0].item() - 0.6) < 1e-6 and got[1].abs().max().item() < 1e-7


def test_rloo_is_not_group_norm_and_keeps_a_group_of_one():
    centred = SCORES - SCORES.mean(dim=1, keepdim=True)
    # n / (n - 1) x (r - mean): the leave-one-out scale, not the plain centring
    torch.testing.assert_close(rloo_advantages(SCORES), centred * 4 / 3, rtol=0, atol=1e-6)
    single = torch.tensor([[0.7], [-0.3]])
    torch.testing.assert_close(rloo_advantages(single), single)
    assert rloo_advantages(SCORES.double()).dtype == torch.float64
