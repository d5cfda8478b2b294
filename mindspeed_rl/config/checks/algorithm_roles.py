"""Checks of the algorithm's keys and of the roles it builds.

What the advantage estimator (``rl_config.adv_estimator``) implies for sequence parallelism,
the group size, sampling, the reward sources and the mini-batch; PPO's critic (present
exactly when the family builds one: its warmup, GAE and value-clip keys), the KL in the
reward, and a reward model in the actor's layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms.family import CRITIC
from mindspeed_rl.config.config_error import ConfigError, require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_algorithm_roles(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first problem of the algorithm's keys, then of its roles
    (the critic, a reward model, the KL in the reward)."""
    _check_algorithm(config)
    _check_roles(config)


def _check_algorithm(config: RLJobConfig) -> None:
    mt, rl, sampling = config.megatron_training, config.rl_config, config.sampling_config
    tp = config.actor_config.tensor_model_parallel_size
    require(not mt.sequence_parallel or tp > 1, "megatron_training.sequence_parallel", True,
            f"needs actor_config.tensor_model_parallel_size > 1 (got {tp})",
            "set sequence_parallel: false or raise tensor_model_parallel_size")
    n, least = rl.n_samples_per_prompt, registry.estimator(rl.adv_estimator).min_group_size
    require(n >= least, "rl_config.n_samples_per_prompt", n,
            f"{rl.adv_estimator} advantages compare the responses of one prompt, so a group "
            f"needs at least {least}", f"use n_samples_per_prompt >= {least} (e.g. 8)")
    require(sampling.temperature > 0 or n == 1, "generate_config.sampling_config.temperature",
            sampling.temperature, f"greedy sampling (0) makes all {n} responses of a prompt "
            "identical, so the group has no signal", "use a temperature > 0, e.g. 1.0")
    require(len(rl.verifier_function) > 0 or config.features.reward_model,
            "rl_config.verifier_function", rl.verifier_function,
            "no reward would be computed (no verifier and no reward_config)",
            "name at least one verifier, e.g. [math_answer], or add a reward model")
    require(len(rl.verifier_weight) == len(rl.verifier_function), "rl_config.verifier_weight",
            rl.verifier_weight, f"has {len(rl.verifier_weight)} weights for "
            f"{len(rl.verifier_function)} verifier_function entries {list(rl.verifier_function)}",
            "give one weight per verifier_function entry")
    gbs, mini = mt.global_batch_size, rl.mini_batch_size
    require(gbs % mini == 0, "rl_config.mini_batch_size", mini,
            f"does not divide megatron_training.global_batch_size={gbs} (prompts per iteration "
            "must split into whole optimizer steps)",
            f"use a divisor of {gbs}, e.g. {_largest_divisor_at_most(gbs, mini)}")


def _check_roles(config: RLJobConfig) -> None:
    """The PPO critic and the reward model: present when needed, in the actor's layout."""
    rl, actor, critic, reward = (config.rl_config, config.actor_config, config.critic_config,
                                 config.reward_config)
    family, estimator = registry.algorithm(config.algorithm), registry.estimator(rl.adv_estimator)
    if CRITIC in family.builds:
        if critic is None:
            raise ConfigError("critic_config", f"{family.launcher} needs a critic_config section "
                              "(the value model)", "add 'critic_config:' with at least lr (e.g. "
                              "lr: 5e-6); its weights default to the actor's model with a new "
                              "value head")
        train_iters = config.megatron_training.train_iters
        require(rl.critic_warmup < train_iters, "rl_config.critic_warmup", rl.critic_warmup,
                f"must be smaller than megatron_training.train_iters={train_iters}, or the "
                "actor never updates", f"use at most {train_iters - 1}")
        require(rl.critic_warmup >= 0, "rl_config.critic_warmup", rl.critic_warmup,
                "must not be negative", "use 0 (no warmup) or a positive number of iterations")
        for key, value in (("rl_config.gamma", rl.gamma), ("rl_config.lam", rl.lam)):
            require(0 <= value <= 1, key, value, "must lie in [0, 1]", "use a value in [0, 1]")
        require(rl.cliprange_value > 0, "rl_config.cliprange_value", rl.cliprange_value,
                "must be greater than 0", "use e.g. 0.5")
        _check_kl_in_reward(rl)
    else:
        if critic is not None:
            raise ConfigError("critic_config", f"{family.launcher} trains no critic "
                              f"({family.name.upper()}'s advantages come from the group or the "
                              "batch)", "remove the section, or launch "
                              f"{_launcher_building(CRITIC)}")
        if estimator.kl_in_reward:
            require(0 <= rl.gamma <= 1, "rl_config.gamma", rl.gamma, "must lie in [0, 1]",
                    "use a value in [0, 1]")
            _check_kl_in_reward(rl)
        else:
            takers = [e.name for e in registry.estimators(family.name) if e.kl_in_reward]
            require(not rl.use_kl_in_reward, "rl_config.use_kl_in_reward", True,
                    f"{family.name.upper()} with adv_estimator {estimator.name} puts the KL into "
                    f"the loss (init_kl_coef)", "set use_kl_in_reward: false"
                    + (f", or adv_estimator: one of {takers}" if takers else ""))
    for name, section in (("critic_config", critic), ("reward_config", reward)):
        if section is None:
            continue
        for size, actor_value in (("tensor_model_parallel_size",
                                   actor.tensor_model_parallel_size),
                                  ("pipeline_model_parallel_size",
                                   actor.pipeline_model_parallel_size)):
            value = getattr(section, size)
            require(value is None or value == actor_value, f"{name}.{size}", value,
                    f"differs from actor_config.{size}={actor_value}: every role shares the "
                    "actor's training layout on the same ranks (co-located SPMD)",
                    f"set it to {actor_value} or leave it out")
        require(section.micro_batch_size > 0, f"{name}.micro_batch_size",
                section.micro_batch_size, "must be greater than 0", "use a positive value")
    if critic is not None:
        require(critic.lr > 0, "critic_config.lr", critic.lr, "must be greater than 0",
                "use e.g. 5e-6")
        require(critic.value_head_init_std is None or critic.value_head_init_std >= 0,
                "critic_config.value_head_init_std", critic.value_head_init_std,
                "must not be negative", "use 0, a small std such as 0.02, or null")
        require(critic.min_lr <= critic.lr, "critic_config.min_lr", critic.min_lr,
                f"exceeds critic_config.lr={critic.lr}", "set min_lr <= lr")
    require(rl.critic_forward_micro_batch_size > 0, "rl_config.critic_forward_micro_batch_size",
            rl.critic_forward_micro_batch_size, "must be greater than 0", "use a positive value")
    if reward is not None:
        require(reward.weight != 0, "reward_config.weight", reward.weight,
                "a reward model with weight 0 only costs time", "give it a non-zero weight, or "
                "remove reward_config")


def _check_kl_in_reward(rl) -> None:
    """The KL controller's keys, read when the KL goes into the per-token reward."""
    require(rl.kl_ctrl_type == "fixed" or rl.use_kl_in_reward, "rl_config.kl_ctrl_type",
            rl.kl_ctrl_type, "the adaptive KL controller scales the KL in the reward, but "
            "rl_config.use_kl_in_reward is false", "set use_kl_in_reward: true, or "
            "kl_ctrl_type: fixed")
    require(rl.kl_horizon > 0 and rl.kl_target > 0, "rl_config.kl_horizon", rl.kl_horizon,
            "kl_horizon and kl_target must be greater than 0", "use e.g. kl_horizon: 10000, "
            "kl_target: 0.1")


def _launcher_building(role: str) -> str:
    """The launcher of the first family that builds ``role``."""
    return next(a.launcher for a in registry.algorithms() if role in a.builds)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)
