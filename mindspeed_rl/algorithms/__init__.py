"""RL algorithms as pure tensor functions (docs/algorithms.md).

No config objects, no globals, no torch.distributed: cross-rank reductions and
global normalisers are passed in by the trainer. Shapes: responses are
right-padded ``[batch, resp_len]`` with a response mask of the same shape.
"""

from mindspeed_rl.algorithms.advantages import (broadcast_to_tokens, gae_advantages,
                                                group_normalized_advantages,
                                                token_level_rewards, whiten)
from mindspeed_rl.algorithms.dapo import groups_with_reward_spread, overlong_penalty
from mindspeed_rl.algorithms.entropy import (entropy_from_logits,
                                             entropy_from_vocab_parallel_logits)
from mindspeed_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from mindspeed_rl.algorithms.kl_controller import KLController, token_mean_kl_per_sequence
from mindspeed_rl.algorithms.logprobs import (logprobs_from_logits,
                                              logprobs_from_vocab_parallel_logits)
from mindspeed_rl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from mindspeed_rl.algorithms.policy_loss import (LOSS_AGG_MODES, OFF_POLICY_IS_THRESHOLD,
                                                 agg_loss, default_loss_agg_mode,
                                                 off_policy_is_weights, policy_loss,
                                                 truncated_is_weights)
from mindspeed_rl.algorithms.value_loss import explained_variance, value_loss

__all__ = [
    "KLController", "KL_ESTIMATORS", "LOSS_AGG_MODES", "OFF_POLICY_IS_THRESHOLD", "agg_loss", "broadcast_to_tokens",
    "default_loss_agg_mode", "entropy_from_logits", "explained_variance", "entropy_from_vocab_parallel_logits", "gae_advantages",
    "group_normalized_advantages", "groups_with_reward_spread", "kl_penalty",
    "logprobs_from_logits", "logprobs_from_vocab_parallel_logits", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "off_policy_is_weights", "overlong_penalty", "policy_loss", "token_level_rewards",
    "token_mean_kl_per_sequence", "truncated_is_weights", "value_loss", "whiten",
]
