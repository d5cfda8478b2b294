"""The PPO family (``pretrain_ppo.py``; MindSpeed-RL's ``ray_ppo``) and its estimator,
``gae``: a critic's values as the baseline, generalised advantage estimation over the
tokens (``advantages.gae_advantages``), whitened over the whole batch."""

from __future__ import annotations

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.advantages import gae_advantages, token_level_rewards
from mindspeed_rl.algorithms.estimator import AdvantageInputs, AdvantageOutputs, Sums
from mindspeed_rl.algorithms.family import CRITIC, Algorithm
from mindspeed_rl.algorithms.masked import whiten_over_ranks
from mindspeed_rl.algorithms.registry import register, register_estimator

PPO = register(Algorithm(
    name="ppo", launcher="pretrain_ppo.py", stages=("ray_ppo",),
    phases=(p.RESHARDING_TO_INFER, p.ROLLOUT, p.RESHARDING_TO_TRAIN, p.REWARD_MODEL, p.REWARD,
            p.VALUES, p.OLD_LOG_P, p.REFERENCE_MODEL, p.GAE, p.CRITIC_UPDATE, p.UPDATE),
    default_estimator="gae", builds=frozenset({CRITIC}),
))


@register_estimator(
    "gae", algorithms=("ppo",), phase=p.GAE, reads=("values",),
    params=("gamma", "lam", "advantage_whiten"), needs=frozenset({CRITIC}), kl_in_reward=True,
    formula="delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; "
            "R_t = A_t + V_t (whitened over the batch when advantage_whiten)",
    source="MindSpeed-RL compute_gae_advantage_return; verl compute_gae_advantage_return")
def gae(x: AdvantageInputs, sums: Sums, gamma: float, lam: float,
        advantage_whiten: bool = True) -> AdvantageOutputs:
    """Token-level GAE on the critic's values: the sequence reward on the last token (minus
    the KL coefficient x the KL on every token when the KL is in the reward); the
    advantages whitened over every rank's tokens; the returns are the critic's targets."""
    mask = x.response_mask
    rewards = token_level_rewards(x.rewards, mask, x.kl, x.kl_coef)
    advantages, returns = gae_advantages(rewards, x.values, mask, gamma, lam)
    if advantage_whiten:
        advantages = whiten_over_ranks(advantages, mask, sums)
    total, tokens = sums([float((returns * mask).sum()), float(mask.sum())])
    return AdvantageOutputs(advantages, returns,
                            {"critic/returns_mean": total / max(tokens, 1.0)})
