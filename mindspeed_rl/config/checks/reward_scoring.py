"""Checks of how rewards are scored: every verifier is registered, and the reward workers
and their batch timeout fit the collectives' timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import ConfigError, require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_reward_scoring(config: RLJobConfig) -> None:
    """Raise `ConfigError` for an unknown verifier, or reward limits that cannot hold."""
    _check_verifiers(config)
    _check_reward_limits(config)


def _check_verifiers(config: RLJobConfig) -> None:
    """Every verifier name exists: an unknown one fails here, not after the first rollout."""
    from mindspeed_rl.rewards.registry import registered_verifiers

    known = registered_verifiers()
    unknown = [name for name in config.rl_config.verifier_function if name not in known]
    if unknown:
        raise ConfigError("rl_config.verifier_function",
                          f"unknown verifier(s) {unknown}",
                          f"registered verifiers are {known}",
                          value=list(config.rl_config.verifier_function))


def _check_reward_limits(config: RLJobConfig) -> None:
    rl = config.rl_config
    require(rl.reward_workers is None or rl.reward_workers >= 0, "rl_config.reward_workers",
            rl.reward_workers, "must not be negative",
            "use 0 (score in the training process), a number of processes, or null (auto)")
    # The other ranks wait for this rank's rewards in the next collective.
    require(rl.reward_batch_timeout_s is None
            or rl.reward_batch_timeout_s < rl.collective_timeout_s,
            "rl_config.reward_batch_timeout_s", rl.reward_batch_timeout_s,
            f"is not below rl_config.collective_timeout_s={rl.collective_timeout_s} (the other "
            "ranks would give up on this one first)",
            "lower it, or set null (half of collective_timeout_s)")
