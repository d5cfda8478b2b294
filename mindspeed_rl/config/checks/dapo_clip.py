"""Checks of the policy loss's clip bounds and of DAPO's keys.

The clip ratios (clip-higher's low and high bounds, the dual-clip bound), dynamic sampling
(``filter_groups_enable``, ``filter_groups_metric``, ``gen_batch_size``,
``max_num_gen_batches``) and the overlong-response penalty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.config.config_error import require
from mindspeed_rl.config.features import family_supports

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_dapo(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first clip bound or DAPO key out of place: bounds out of
    order, dynamic sampling where no group can be filtered, a round size without it, an
    overlong buffer as long as max_tokens."""
    rl, sampling = config.rl_config, config.sampling_config
    low = rl.clip_ratio if rl.clip_ratio_low is None else rl.clip_ratio_low
    high = rl.clip_ratio if rl.clip_ratio_high is None else rl.clip_ratio_high
    require(low > 0 and (low < 1 or rl.policy_loss == "gspo"), "rl_config.clip_ratio_low", low,
            "must lie in (0, 1)", "use e.g. 0.2")
    require(high >= low, "rl_config.clip_ratio_high", high,
            f"is smaller than rl_config.clip_ratio_low={low}: clip-higher widens the upper "
            "side", f"use at least {low}, e.g. DAPO's 0.28 with 0.2")
    require(rl.clip_ratio_c is None or rl.clip_ratio_c > 1, "rl_config.clip_ratio_c",
            rl.clip_ratio_c, "the dual-clip bound must be greater than 1", "use e.g. 3.0, or "
            "null")
    require(rl.rollout_is_threshold is None or rl.rollout_is_threshold > 0,
            "rl_config.rollout_is_threshold", rl.rollout_is_threshold, "must be greater than 0",
            "use e.g. 2.0, or null")
    if config.features.dynamic_sampling:
        require(family_supports(config, names.DYNAMIC_SAMPLING),
                "rl_config.filter_groups_enable", True, "dynamic sampling filters GRPO groups "
                "(pretrain_grpo.py); PPO's advantages do not vanish with equal rewards",
                "set filter_groups_enable: false")
        require(rl.n_samples_per_prompt >= 2, "rl_config.filter_groups_enable", True,
                f"with n_samples_per_prompt={rl.n_samples_per_prompt} every group has one "
                "sample: none has a spread, so dynamic sampling would drop them all",
                "use n_samples_per_prompt >= 2, or filter_groups_enable: false")
        metrics = ["reward", *rl.verifier_function]
        require(rl.filter_groups_metric in metrics, "rl_config.filter_groups_metric",
                rl.filter_groups_metric, "is neither reward nor one of "
                f"rl_config.verifier_function {list(rl.verifier_function)}",
                f"use one of {metrics}")
    require(rl.gen_batch_size is None or config.features.dynamic_sampling,
            "rl_config.gen_batch_size", rl.gen_batch_size, "sets the prompts of a "
            "dynamic-sampling round, but filter_groups_enable is off",
            "remove it, or set filter_groups_enable: true")
    require(rl.gen_batch_size is None or rl.gen_batch_size > 0, "rl_config.gen_batch_size",
            rl.gen_batch_size, "must be greater than 0", "use a positive number of prompts")
    require(rl.max_num_gen_batches >= 0, "rl_config.max_num_gen_batches",
            rl.max_num_gen_batches, "must not be negative", "use 0 (no limit) or a positive "
            "number of generation rounds")
    require(0 <= rl.overlong_buffer_len < sampling.max_tokens, "rl_config.overlong_buffer_len",
            rl.overlong_buffer_len, f"must be in [0, generate_config.sampling_config.max_tokens="
            f"{sampling.max_tokens}) (the penalty starts at max_tokens - overlong_buffer_len)",
            f"use e.g. {sampling.max_tokens // 4}, or 0 to turn the penalty off")
    require(rl.overlong_penalty_factor >= 0, "rl_config.overlong_penalty_factor",
            rl.overlong_penalty_factor, "must not be negative", "use e.g. 1.0")
