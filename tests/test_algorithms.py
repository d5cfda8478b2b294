"""Algorithms against hand-computed values (small tensors, numbers written out)."""

import math
import threading

import pytest
import torch

from mindspeed_rl.algorithms import (agg_loss, broadcast_to_tokens, entropy_from_logits,
                                     entropy_from_vocab_parallel_logits, gae_advantages,
                                     group_normalized_advantages, groups_with_reward_spread,
                                     kl_penalty, logprobs_from_logits,
                                     logprobs_from_vocab_parallel_logits, masked_mean,
                                     masked_whiten, overlong_penalty, policy_loss, value_loss)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32),
                               atol=tol, rtol=tol)


# ---- masked reductions ----

def test_masked_mean_ignores_padding_and_empty_mask_is_zero():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    close(masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 0]])
    # mean 2, unbiased var ((1)^2 + (1)^2) / 1 = 2
    close(masked_whiten(x, mask), [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]])


# ---- advantages ----

def test_group_normalized_two_groups_of_two():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    # group 1: mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.7071068 -> +-0.5 / 0.7071068
    # group 2: identical rewards -> 0 (not NaN)
    adv = group_normalized_advantages(rewards, n_samples_per_prompt=2, eps=1e-6)
    close(adv, [0.7071058, -0.7071058, 0.0, 0.0])


def test_group_normalized_group_of_three_and_2d_input():
    rewards = torch.tensor([[0.0, 0.0, 3.0]])
    # mean 1, unbiased var (1 + 1 + 4) / 2 = 3, std 1.7320508
    adv = group_normalized_advantages(rewards, 3, eps=0.0)
    assert adv.shape == (1, 3)
    close(adv, [[-0.5773503, -0.5773503, 1.1547005]])
    close(group_normalized_advantages(rewards, 3, norm_by_std=False), [[-1.0, -1.0, 2.0]])


def test_group_normalized_single_sample_and_errors():
    close(group_normalized_advantages(torch.tensor([0.3, 1.0]), 1), [0.3, 1.0])
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=3"):
        group_normalized_advantages(torch.zeros(4), 3)


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(broadcast_to_tokens(torch.tensor([0.5, -2.0]), mask), [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 9.9]])  # 9.9 sits on padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # reward-to-go: [1, 1, 1] and [2, 2, -]
    close(adv, [[0.5, 0.8, 0.9], [1.7, 1.6, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])


def test_gae_discounted_and_td0():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    mask = torch.ones(1, 3)
    # gamma 0.5, lam 1: A_t = discounted return - V_t = [0.25 - 0.5, 0.5 - 0.2, 1 - 0.1]
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    close(adv, [[-0.25, 0.3, 0.9]])
    # lam 0: A_t = delta_t = r_t + 0.5 V_{t+1} - V_t
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)
    close(adv, [[0.1 - 0.5, 0.05 - 0.2, 0.9]])


# ---- DAPO ----

def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    close(overlong_penalty(lengths, 10, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5)[3], -0.25)
    with pytest.raises(ValueError, match="overlong_buffer_len=0"):
        overlong_penalty(lengths, 10, 0)


def test_groups_with_reward_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert groups_with_reward_spread(rewards, 2).tolist() == [False, True, False]
    # groups of one sample never carry a signal
    assert groups_with_reward_spread(torch.tensor([0.0, 1.0, 0.5]), 1).tolist() == [False] * 3
    assert groups_with_reward_spread(torch.tensor([0.2, 0.2, 0.2, 0.3]), 4).tolist() == [True]
    with pytest.raises(ValueError, match="row 3 \\(group 1\\) is NaN"):
        groups_with_reward_spread(torch.tensor([1.0, 0.0, 1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="do not split into groups"):
        groups_with_reward_spread(torch.tensor([1.0, 0.0, 1.0]), 2)


# ---- KL ----

def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])  # logp - ref = [1, -1]
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5]])
    # MindSpeed-RL's names
    close(kl_penalty(logp, ref, "kl"), [[1.0, -1.0]])
    close(kl_penalty(logp, ref, "abs"), [[1.0, 1.0]])
    close(kl_penalty(logp, ref, "mse"), [[0.5, 0.5]])
    # exp(ref - logp) - (ref - logp) - 1: [e^-1 + 1 - 1, e^1 - 1 - 1]
    close(kl_penalty(logp, ref, "low_var_kl"), [[0.3678794, 0.7182818]])
    close(kl_penalty(logp, ref, "k3"), [[0.3678794, 0.7182818]])


def test_low_var_kl_is_clamped_and_finite():
    logp = torch.tensor([[-40.0, 0.0]])
    ref = torch.tensor([[0.0, -40.0]])
    out = kl_penalty(logp, ref, "low_var_kl")
    assert torch.isfinite(out).all()
    # ref - logp = 40 -> clamped to 20 -> e^20 - 21, clamped to 10;
    # ref - logp = -40 -> -20 -> e^-20 + 20 - 1 = 19, clamped to 10
    close(out, [[10.0, 10.0]])


def test_unknown_kl_names_valid_ones():
    with pytest.raises(ValueError, match=r"'k4'.*\['k1', 'kl', 'abs', 'k2', 'mse', 'low_var_kl', "
                                         r"'k3'\]"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---- policy loss ----
# Tokens (old log-prob 0, so ratio = exp(logp)):
#   a: A=+1, ratio 1.5 -> max(-1.5, -1.2) = -1.2  (clipped branch active)
#   b: A=+1, ratio 0.5 -> max(-0.5, -0.8) = -0.5
#   c: A=-1, ratio 0.5 -> max( 0.5,  0.8) =  0.8  (clipped branch active)
#   d: A=-1, ratio 1.5 -> max( 1.5,  1.2) =  1.5
#   e: A=+1, ratio 1.1 -> -1.1 (inside the clip range)
# Layout [[a, b, pad], [c, d, e]].

def _policy_batch():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.1]])
    logprobs = torch.log(ratios).requires_grad_(True)
    logprobs_old = torch.zeros(2, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs, logprobs_old, advantages, mask


def test_policy_loss_clips_both_sides_token_mean():
    logprobs, old, adv, mask = _policy_batch()
    loss, stats = policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    close(loss, (-1.2 - 0.5 + 0.8 + 1.5 - 1.1) / 5)  # -0.1
    close(stats["pg_clipfrac"], 2 / 5)
    # approx_kl = mean(old - new) = -(ln1.5 + ln0.5 + ln0.5 + ln1.5 + ln1.1) / 5
    close(stats["approx_kl"], -(0.4054651 - 0.6931472 - 0.6931472 + 0.4054651 + 0.0953102) / 5)
    close(stats["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)
    close(stats["pg_clipfrac_lower"], 0.0)
    loss.backward()
    # d loss / d logp = -A * ratio / N on unclipped tokens, 0 on clipped tokens and padding
    close(logprobs.grad, [[0.0, -0.5 / 5, 0.0], [0.0, 1.5 / 5, -1.1 / 5]])


def test_policy_loss_clip_higher_is_asymmetric():
    logprobs, old, adv, mask = _policy_batch()
    # DAPO clip-higher: token a is capped at 1.28 instead of 1.2; token c still at 0.8
    loss, stats = policy_loss(logprobs, old, adv, mask, 0.2, 0.28)
    close(loss, (-1.28 - 0.5 + 0.8 + 1.5 - 1.1) / 5)
    close(stats["pg_clipfrac"], 2 / 5)


def test_policy_loss_aggregation_modes_and_global_token_count():
    logprobs, old, adv, mask = _policy_batch()
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, num_tokens_global=10)
    close(loss, -0.5 / 10)
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    close(loss, ((-1.2 - 0.5) / 2 + (0.8 + 1.5 - 1.1) / 3) / 2)  # -0.225
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "seq-mean-token-sum")
    close(loss, ((-1.2 - 0.5) + (0.8 + 1.5 - 1.1)) / 2)  # -0.25
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "seq-mean-token-sum",
                          num_seqs_global=4)
    close(loss, -0.5 / 4)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(logprobs, old, adv, mask, 0.2, 0.2, "token-sum")


def test_token_mean_shares_sum_to_the_global_mean():
    # Two "ranks" with different token counts: the shares with the global count add
    # up to the token mean of the concatenated batch.
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    share_0 = agg_loss(loss_mat[:1], mask[:1], num_tokens_global=4)
    share_1 = agg_loss(loss_mat[1:], mask[1:], num_tokens_global=4)
    close(share_0 + share_1, agg_loss(loss_mat, mask))  # 10 / 4


def test_policy_loss_per_sample_advantages_and_dual_clip():
    logprobs = torch.log(torch.tensor([[4.0, 1.0]]))
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    # A = -1, ratio 4: max(4, 1.2) = 4, dual clip bounds it at -A * 3 = 3; ratio 1 -> 1
    loss, stats = policy_loss(logprobs, old, torch.tensor([-1.0]), mask, 0.2, 0.2,
                              clip_ratio_dual=3.0)
    close(loss, (3.0 + 1.0) / 2)
    close(stats["pg_clipfrac_lower"], 0.5)


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    values_old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, stats = value_loss(values, values_old, returns, mask, clip_range_value=0.5)
    # token 0: (1 - 0)^2 = 1 vs clipped (0.5 - 0)^2 = 0.25 -> 1; token 1: 1 vs 1 -> 1
    close(loss, 0.5 * (1.0 + 1.0) / 2)
    close(stats["vf_clipfrac"], 0.0)
    # V moved from 0 to 2 towards R = 3: unclipped (2 - 3)^2 = 1, clipped (0.5 - 3)^2 = 6.25
    loss, stats = value_loss(torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[3.0]]),
                             torch.ones(1, 1), clip_range_value=0.5)
    close(loss, 0.5 * 6.25)
    close(stats["vf_clipfrac"], 1.0)



def test_value_clip_fraction_counts_only_values_outside_the_range():
    """Inside [V_old - c, V_old + c] both branches are the same number, so no token counts
    as clipped however V_old + (V - V_old) rounds (in fp32 it often differs from V)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 4096, generator=g) * 0.3
    values_old = 0.5 * values + torch.randn(1, 4096, generator=g) * 0.15
    returns = torch.randn(1, 4096, generator=g) * 3
    inside = ((values - values_old).abs() < 0.2).float()  # the loss reads these tokens only
    assert inside.sum() > 2000
    loss, stats = value_loss(values, values_old, returns, inside, clip_range_value=0.2)
    assert float(stats["vf_clipfrac"]) == 0.0
    close(loss, 0.5 * ((values - returns).square() * inside).sum() / inside.sum())


# ---- entropy and log-probs ----

def test_entropy_uniform_and_peaked():
    uniform = torch.zeros(1, 1, 4)
    close(entropy_from_logits(uniform), [[math.log(4)]])  # 1.3862944
    two_way = torch.tensor([[[math.log(3.0), 0.0]]])  # p = [0.75, 0.25]
    close(entropy_from_logits(two_way), [[0.75 * 0.2876821 + 0.25 * 1.3862944]])  # 0.5623351
    peaked = torch.tensor([[[1000.0, 0.0, 0.0, 0.0]]])
    out = entropy_from_logits(peaked)
    assert torch.isfinite(out).all()
    close(out, [[0.0]])


def test_logprobs_from_logits_by_hand():
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0]]])
    targets = torch.tensor([[0, 1]])
    close(logprobs_from_logits(logits, targets), [[math.log(0.75), math.log(0.5)]])


class _SimulatedTPGroup:
    """Lock-step all-reduces between threads: thread r plays tensor-parallel rank r.

    The reduction keeps the autograd graph of every rank's contribution, so a
    backward from rank 0's output reaches the logits of all shards.
    """

    def __init__(self, world_size):
        self.world_size = world_size
        self.slots = [None] * world_size
        self.barrier = threading.Barrier(world_size)

    def reducer(self, rank, op):
        def reduce(t):
            self.slots[rank] = t
            self.barrier.wait()
            out = op(torch.stack(self.slots), dim=0)
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return out.values if op is torch.max else out
        return reduce


def _run_shards(fn, shards, **kwargs):
    group = _SimulatedTPGroup(len(shards))
    outputs, errors = [None] * len(shards), []

    def body(rank):
        try:
            outputs[rank] = fn(shards[rank], rank, group.reducer(rank, torch.max),
                               group.reducer(rank, torch.sum))
        except Exception as e:  # surface thread failures in the test
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outputs


def test_vocab_parallel_entropy_matches_full_vocab_with_grads():
    torch.manual_seed(0)
    logits = (torch.randn(2, 3, 10) * 5).requires_grad_(True)
    shards = [logits[..., :5], logits[..., 5:]]
    outputs = _run_shards(lambda s, r, mx, sm: entropy_from_vocab_parallel_logits(s, mx, sm),
                          shards)
    expected = entropy_from_logits(logits)
    for out in outputs:
        close(out, expected)
    (grad_parallel,) = torch.autograd.grad(outputs[0].sum(), logits)
    (grad_full,) = torch.autograd.grad(expected.sum(), logits)
    close(grad_parallel, grad_full)


def test_vocab_parallel_logprobs_match_full_vocab_with_grads():
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 8) * 3).requires_grad_(True)
    targets = torch.tensor([[0, 3, 4, 7], [5, 1, 2, 6]])  # targets in both shards
    shards = [logits[..., :4], logits[..., 4:]]
    outputs = _run_shards(lambda s, r, mx, sm: logprobs_from_vocab_parallel_logits(
        s, targets, 4 * r, mx, sm), shards)
    expected = logprobs_from_logits(logits, targets)
    for out in outputs:
        close(out, expected)
    (grad_parallel,) = torch.autograd.grad(outputs[1].sum(), logits)
    (grad_full,) = torch.autograd.grad(expected.sum(), logits)
    close(grad_parallel, grad_full)


# ---- PPO: rewards per token, whitening, KL controller ----

def test_token_level_rewards_score_on_last_token_and_kl_everywhere():
    from mindspeed_rl.algorithms import token_level_rewards

    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 5.0])  # the empty row gets nothing
    close(token_level_rewards(scores, mask), [[0, 0, 2.0], [0, -1.0, 0], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0], [1.0, 1.0, 1.0]])
    close(token_level_rewards(scores, mask, kl, kl_coef=0.5),
          [[-0.05, -0.1, 2.0 - 0.15], [-0.25, -1.25, 0], [0, 0, 0]])


def test_whiten_with_given_statistics():
    from mindspeed_rl.algorithms import whiten

    x = torch.tensor([[1.0, 3.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(whiten(x, mask, mean=2.0, var=4.0, eps=0.0), [[-0.5, 0.5, 0.0]])


def test_adaptive_kl_controller_by_hand():
    from mindspeed_rl.algorithms import KLController

    fixed = KLController(0.1)
    assert fixed.update(50.0, 256) == 0.1
    ctl = KLController(0.1, "adaptive", target=6.0, horizon=1000)
    # kl 9 = 1.5 x target: the error 0.5 is clipped to 0.2; beta *= 1 + 0.2 * 256 / 1000
    close(ctl.update(9.0, 256), 0.1 * 1.0512)
    # kl 4.5: error -0.25 -> clipped -0.2; beta *= 1 - 0.2 * 500 / 1000
    close(ctl.update(4.5, 500), 0.1 * 1.0512 * 0.9)
    # kl 6.6: error 0.1 (inside the clip); beta *= 1 + 0.1 * 100 / 1000
    before = ctl.value
    close(ctl.update(6.6, 100), before * 1.01)
    restored = KLController(1.0, "adaptive")
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="kl_ctrl_type"):
        KLController(0.1, "pid")


# ---- DAPO / Dr.GRPO / GSPO: aggregation exact over splits, sequence ratios, IS weights ----

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_every_loss_agg_mode_is_exact_over_micro_batches_and_dp_ranks(mode):
    """5 rows split unevenly: rank 0 holds rows 0-2 as micro-batches [0], [1, 2]; rank 1
    holds rows 3-4 as one micro-batch. With the global token and sequence counts the shares
    add up to the unsplit batch's loss, and so do the gradients."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 3, 7, 2]
    mask = torch.zeros(5, 7)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = (-torch.rand(5, 7, generator=g)).requires_grad_(True)
    old = -torch.rand(5, 7, generator=g)
    adv = torch.randn(5, generator=g)
    common = dict(num_tokens_global=float(mask.sum()), num_seqs_global=5.0, norm_length=7.0)
    whole, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, mode, **common)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    total = torch.zeros(())
    for rows in ([0], [1, 2], [3, 4]):
        share, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], 0.2, 0.28, mode,
                               **common)
        total = total + share
    (grad_split,) = torch.autograd.grad(total, logp)
    close(total, whole, tol=1e-6)
    close(grad_split, grad_whole, tol=1e-6)


def test_dr_grpo_normalises_by_a_constant_length():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # (1/2) * ((1+2+3)/8 + 4/8) with the generation budget 8
    close(agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_length=8), (6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")


def test_gspo_uses_the_sequence_ratio_and_clips_it():
    # row 0: log-ratios [ln 1.5, ln 1.0] -> s = exp(mean) = sqrt(1.5) = 1.2247, A = +1
    #        clip-high 0.1 -> capped at 1.1 (clipped branch, no gradient)
    # row 1: log-ratios [ln 0.99, ln 1.01, ln 1.0] -> s = (0.99*1.01)^(1/3) = 0.99997, A = -1
    #        inside [0.9, 1.1]: unclipped, every token gets gradient -A*s/N
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.99, 1.01, 1.0]])).requires_grad_(True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logp, old, adv, mask, 0.1, 0.1, "seq-mean-token-mean",
                              ratio_level="sequence")
    s1 = (0.99 * 1.01) ** (1 / 3)
    close(loss, ((-1.1 - 1.1) / 2 + (s1 * 3) / 3) / 2, tol=1e-5)
    close(stats["pg_clipfrac"], 2 / 5)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, 0.0, 0.0], [s1 / 3 / 2] * 3], tol=1e-5)


def test_truncated_is_weights_cap_the_rollout_ratio():
    from mindspeed_rl.algorithms import truncated_is_weights

    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    # ratios old/rollout = [2, 0.5, 9] -> capped at 3
    close(truncated_is_weights(old, rollout, 3.0), [[2.0, 0.5, 3.0]])
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 3), 0.2, 0.2,
                          is_weights=torch.tensor([[2.0, 0.5, 3.0]]))
    close(loss, -(2.0 + 0.5 + 3.0) / 3)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        truncated_is_weights(old, rollout, 0.0)


def test_packed_sequences_aggregate_like_rows():
    """Responses packed along one row with segment ids give the row layout's loss, GSPO
    ratio and gradient (the trainer packs rows when use_remove_padding is on)."""
    g = torch.Generator().manual_seed(1)
    lengths = [2, 4, 1]
    rows_mask = torch.zeros(3, 4)
    for i, n in enumerate(lengths):
        rows_mask[i, :n] = 1
    logp_rows = (-torch.rand(3, 4, generator=g)).requires_grad_(True)
    old_rows = -torch.rand(3, 4, generator=g)
    adv = torch.tensor([1.0, -0.5, 2.0])
    # the same tokens packed into one row of 7, segment ids 0 0 1 1 1 1 2
    idx = [(i, t) for i, n in enumerate(lengths) for t in range(n)]
    seg = torch.tensor([[i for i, _ in idx]])
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"):
        for level in ("token", "sequence"):
            kw = dict(loss_agg_mode=mode, norm_length=4, ratio_level=level)
            rows_loss, _ = policy_loss(logp_rows, old_rows, adv, rows_mask, 0.2, 0.28, **kw)
            packed_logp = torch.stack([logp_rows[i, t] for i, t in idx])[None]
            packed_old = torch.stack([old_rows[i, t] for i, t in idx])[None]
            packed_adv = torch.stack([adv[i] for i, _ in idx])[None]
            packed_loss, _ = policy_loss(packed_logp, packed_old, packed_adv,
                                         torch.ones(1, 7), 0.2, 0.28, segment_ids=seg, **kw)
            close(packed_loss, rows_loss, tol=1e-6)
            (g_rows,) = torch.autograd.grad(rows_loss, logp_rows)
            (g_packed,) = torch.autograd.grad(packed_loss, logp_rows)
            close(g_packed, g_rows, tol=1e-6)


# ---- formulas put back wrong must fail here ----

def test_dual_clip_leaves_positive_advantage_tokens_alone():
    """Dual-clip bounds only tokens with A < 0: a positive-advantage token with a large
    ratio keeps PPO's clipped loss -A * (1 + eps), not -A * c."""
    logprobs = torch.log(torch.tensor([[5.0, 5.0]]))
    old = torch.zeros(1, 2)
    loss, stats = policy_loss(logprobs, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2),
                              0.2, 0.2, clip_ratio_dual=3.0)
    # A = 2, ratio 5: max(-10, -2.4) = -2.4 (dual clip would give -6);
    # A = -1, ratio 5: max(5, 0.8) = 5, bounded by -A * c = 3
    close(loss, (-2.4 + 3.0) / 2)
    close(stats["pg_clipfrac_lower"], 0.5)


def test_grpo_epsilon_keeps_near_equal_groups_finite_and_damped():
    """A_i = (r_i - mean) / (std + eps): eps keeps a group of equal rewards at 0 (not NaN)
    and damps a group whose spread is of the order of eps."""
    rewards = torch.tensor([0.0, 2e-6, 1.0, 1.0])
    adv = group_normalized_advantages(rewards, 2, eps=1e-6)
    # group 1: mean 1e-6, std sqrt(2) * 1e-6 -> +-1e-6 / (1.4142136e-6 + 1e-6) = +-0.4142136
    close(adv, [-0.4142136, 0.4142136, 0.0, 0.0])
    assert torch.isfinite(group_normalized_advantages(torch.ones(4), 2)).all()


def test_kl_controller_input_is_the_per_token_kl_averaged_over_sequences():
    """verl's and MindSpeed-RL's controller input: each sequence's token-mean KL, averaged
    over the sequences (not a per-sequence sum, not a mean over all tokens)."""
    from mindspeed_rl.algorithms import KLController, token_mean_kl_per_sequence

    kl = torch.tensor([[0.1, 0.3, 9.0], [0.4, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    per_seq = token_mean_kl_per_sequence(kl, mask)
    close(per_seq, [0.2, 0.4])
    current = float(per_seq.mean())  # 0.3; the per-sequence sum would be 0.4, the token mean 0.8/3
    ctl = KLController(1.0, "adaptive", target=0.35, horizon=10)
    # 0.3 / 0.35 - 1 = -0.142857: beta *= 1 - 0.142857 * 2 / 10 (a per-sequence sum, 0.4,
    # would raise it)
    close(ctl.update(current, 2), 1.0 - 0.1428571 * 0.2)
    close(token_mean_kl_per_sequence(torch.ones(1, 2), torch.zeros(1, 2)), [0.0])


def test_explained_variance_is_undefined_when_the_returns_do_not_vary():
    from mindspeed_rl.algorithms import explained_variance

    # equal returns 0.7 (float32 sums leave rounding noise in E[R^2] - E[R]^2)
    # (here +8e-8: without the guard, 1 - Var[R - V] / 8e-8 is about -1e6)
    returns = torch.full((16,), 0.7, dtype=torch.float32)
    residual = returns - torch.linspace(0.5, 0.9, 16)
    sums = [float(returns.sum()), float(returns.square().sum()), float(residual.sum()),
            float(residual.square().sum()), 16.0]
    assert sums[1] / 16 - (sums[0] / 16) ** 2 > 0
    assert math.isnan(explained_variance(*sums))
    assert math.isnan(explained_variance(0.0, 0.0, 0.0, 0.0, 4.0))  # every reward 0
    # returns [0, 1, 0, 1], values [0, 1, 0, 0]: Var[R] = 0.25, Var[R - V] = 0.1875
    close(explained_variance(2.0, 2.0, 1.0, 1.0, 4.0), 1.0 - 0.1875 / 0.25)


def test_gspo_aggregates_as_its_definition_unless_told_otherwise():
    from mindspeed_rl.algorithms import default_loss_agg_mode

    assert default_loss_agg_mode("gspo") == "seq-mean-token-mean"
    assert default_loss_agg_mode("vanilla") == "token-mean"
