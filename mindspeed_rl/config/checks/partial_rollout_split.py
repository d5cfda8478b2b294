"""Checks of partial rollout (``rl_config.partial_rollout_max_split``: N > 1 spreads every
response over at most N rollout passes, carrying unfinished rows across iterations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import require
from mindspeed_rl.config.features import family_supports

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_partial_rollout(config: RLJobConfig) -> None:
    """Raise `ConfigError` for a split a rollout pass cannot honour, or partial rollout in a
    family or with sampling it is not built for."""
    rl, max_tokens = config.rl_config, config.sampling_config.max_tokens
    split = rl.partial_rollout_max_split
    key = "rl_config.partial_rollout_max_split"
    require(split >= 1, key, split, "must be at least 1 (1 = off, N > 1: every response is "
            "complete within N rollout passes)", "use 1, or e.g. 2")
    require(split <= max_tokens, key, split, f"exceeds generate_config.sampling_config."
            f"max_tokens={max_tokens}: a rollout pass would generate less than one token",
            f"use at most {max_tokens}, e.g. 2 or 4")
    if config.features.partial_rollout:
        require(family_supports(config, "partial_rollout"), key, split,
                "partial rollout runs with GRPO and DAPO (pretrain_grpo.py), as in "
                "MindSpeed-RL; PPO's critic and GAE are not built for rows that span "
                "iterations", "set partial_rollout_max_split: 1 for PPO")
        require(config.sampling_config.temperature > 0 or rl.n_samples_per_prompt == 1, key,
                split, "greedy sampling with n_samples_per_prompt > 1 cannot form a group",
                "raise generate_config.sampling_config.temperature")
