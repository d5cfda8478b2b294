"""The PPO family (``pretrain_ppo.py``; MindSpeed-RL's ``ray_ppo``) and its estimator,
``gae``: a critic's values as the baseline, generalised advantage estimation over the
tokens (``advantages.gae_advantages``; its phase is ``trainer/phases.py``'s ``gae``)."""

from __future__ import annotations

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.advantages import gae_advantages
from mindspeed_rl.algorithms.family import CRITIC, Algorithm, Estimator

PPO = Algorithm(
    name="ppo", launcher="pretrain_ppo.py", stages=("ray_ppo",),
    phases=(p.RESHARDING_TO_INFER, p.ROLLOUT, p.RESHARDING_TO_TRAIN, p.REWARD_MODEL, p.REWARD,
            p.VALUES, p.OLD_LOG_P, p.REFERENCE_MODEL, p.GAE, p.CRITIC_UPDATE, p.UPDATE),
    default_estimator="gae", builds=frozenset({CRITIC}),
)

GAE = Estimator(
    name="gae", algorithms=("ppo",), phase=p.GAE, fn=gae_advantages, params=("gamma", "lam"),
    needs=frozenset({CRITIC}), kl_in_reward=True,
    formula="delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; "
            "R_t = A_t + V_t (whitened over the batch when advantage_whiten)",
    source="MindSpeed-RL compute_gae_advantage_return; verl compute_gae_advantage_return",
)
