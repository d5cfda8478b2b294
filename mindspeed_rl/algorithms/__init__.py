"""RL algorithms as pure tensor functions (docs/algorithms.md).

No config objects, no globals, no torch.distributed: cross-rank reductions and global
normalisers are passed in by the trainer. Shapes: responses are right-padded
``[batch, resp_len]`` with a response mask of the same shape. Importing the package
registers the families and estimators (each where it is defined: ``registry.py``).
"""

# Registers the families and estimators, in the order errors and the docs list them.
from mindspeed_rl.algorithms import grpo, ppo, rloo, reinforce_plus_plus, distillation, dpo  # noqa: F401, I001
from mindspeed_rl.algorithms.advantages import (broadcast_to_tokens, gae_advantages,
                                                group_normalized_advantages, token_level_rewards)
from mindspeed_rl.algorithms.dapo import groups_with_reward_spread, overlong_penalty
from mindspeed_rl.algorithms.entropy import entropy_from_logits, entropy_from_vocab_parallel_logits
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from mindspeed_rl.algorithms.kl_controller import KLController, token_mean_kl_per_sequence
from mindspeed_rl.algorithms.logprobs import logprobs_from_logits, logprobs_from_vocab_parallel_logits
from mindspeed_rl.algorithms.masked import (masked_mean, masked_sum, masked_var, masked_whiten, whiten,
                                            whiten_over_ranks)
from mindspeed_rl.algorithms.policy_loss import (LOSS_AGG_MODES, OFF_POLICY_IS_THRESHOLD, agg_loss,
                                                 default_loss_agg_mode, off_policy_is_weights,
                                                 policy_loss, truncated_is_weights)
from mindspeed_rl.algorithms.value_loss import explained_variance, value_loss
