"""Rule-based rewards: verifiers registered by name (``rl_config.verifier_function``).

Registered verifiers:
- ``math_answer``: math-verify equivalence of the final answer with the gold answer.
- ``integer_answer``: the response's final integer equals the integer gold answer.
- ``final_answer_format``: the response ends with a recognisable final answer.
- MindSpeed-RL's names, with their scoring rules: ``math_17k_acc``, ``acc_for_ppo``,
  ``base_acc``, ``math_verify_reward``, ``acc_for_dapo``, ``retool_reward``, ``acc``,
  ``format`` (the ``<think>``/``<answer>`` tags), ``strict_format``, ``step``
  (`mindspeed_rl.rewards.mindspeed_rl_verifiers`).

In a job every call runs in a worker process with a time limit
(`mindspeed_rl.rewards.verifier_pool`, ``rl_config.reward_workers``).
"""

# Importing the modules registers their verifiers.
from mindspeed_rl.rewards import final_answer, math_verify_reward, mindspeed_rl_verifiers  # noqa: F401
from mindspeed_rl.rewards.final_answer import (extract_final_integer, extract_final_number,
                                               has_final_answer_format)
from mindspeed_rl.rewards.mindspeed_rl_verifiers import retool_call_bonus
from mindspeed_rl.rewards.verifier_pool import (RewardLimits, RewardPool, RewardPoolError,
                                                reward_pool_for)
from mindspeed_rl.rewards.registry import get_verifier, register_verifier, registered_verifiers
from mindspeed_rl.rewards.scoring import (NonFiniteRewardError, check_finite_scores,
                                          compute_rewards)

__all__ = [
    "NonFiniteRewardError", "check_finite_scores", "compute_rewards", "extract_final_integer", "extract_final_number", "get_verifier",
    "has_final_answer_format", "register_verifier", "registered_verifiers", "RewardLimits",
    "RewardPool", "RewardPoolError", "retool_call_bonus", "reward_pool_for",
]
