"""Consistency checks of a loaded job that do not depend on the world size.

Each check names the key(s) at fault, the value and a fix. The world-size
dependent checks (layouts, batch splits over data-parallel ranks) live in
`mindspeed_rl.config.plan`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms.family import CRITIC
from mindspeed_rl.config.batch_plan import packing_budgets
from mindspeed_rl.config.deepseek_checks import routing_problems
from mindspeed_rl.config.errors import ConfigError
from mindspeed_rl.config.teacher import check_teacher

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def _require(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, problem, fix, value=value)


def check_job(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first inconsistency found (model, ranges, cross-key)."""
    _check_model(config)
    _check_ranges(config)
    _check_dapo(config)   # before the group-size check: its message names the DAPO key
    _check_rollout_correction(config)
    _check_router_replay(config)
    _check_algorithm(config)
    _check_roles(config)
    _check_lengths(config)
    _check_training_features(config)
    _check_context_parallel(config)
    _check_lora(config)
    _check_generation_features(config)
    _check_partial_rollout(config)
    _check_multi_turn(config)
    _check_verifiers(config)
    _check_reward_limits(config)
    check_teacher(config)  # on-policy distillation (config/teacher.py)


def _check_model(config: RLJobConfig) -> None:
    m = config.model
    where = f"(in {m.source})"
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "vocab_size", "num_key_value_heads", "head_dim", "num_experts",
                 "moe_intermediate_size", "num_experts_per_tok", "max_position_embeddings"):
        value = getattr(m, name)
        _require(value is None or value > 0, f"model.{name}", value, f"must be positive {where}",
                 "copy the value from the model's config.json")
    if m.head_dim is None:
        _require(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size", m.hidden_size,
                 f"not divisible by num_attention_heads={m.num_attention_heads} {where}",
                 "set head_dim explicitly")
    _require(m.num_attention_heads % m.num_kv_heads == 0, "model.num_key_value_heads",
             m.num_kv_heads, f"does not divide num_attention_heads={m.num_attention_heads} "
             f"{where}", "copy both from the model's config.json")
    if m.is_moe:
        _require(m.moe_intermediate_size is not None, "model.moe_intermediate_size", None,
                 f"required when num_experts is set {where}", "copy it from config.json")
        _require(m.num_experts_per_tok is None or m.num_experts_per_tok <= m.num_experts,
                 "model.num_experts_per_tok", m.num_experts_per_tok,
                 f"exceeds num_experts={m.num_experts} {where}", "copy it from config.json")
    if m.is_mla:
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        problems = routing_problems(fields, lambda name: f"model.{name}")
        if problems:
            raise problems[0]
    ep = config.actor_config.expert_model_parallel_size
    _require(ep == 1 or m.is_moe, "actor_config.expert_model_parallel_size", ep,
             f"the model ({m.model_type}) has no experts", "set it to 1 for dense models")


def _check_ranges(config: RLJobConfig) -> None:
    mt, actor, rl = config.megatron_training, config.actor_config, config.rl_config
    gen, sampling = config.generate_config, config.sampling_config
    positive = {
        "megatron_training.global_batch_size": mt.global_batch_size,
        "megatron_training.seq_length": mt.seq_length,
        "megatron_training.train_iters": mt.train_iters,
        "megatron_training.num_test_prompts": mt.num_test_prompts,
        "actor_config.micro_batch_size": actor.micro_batch_size,
        "actor_config.tensor_model_parallel_size": actor.tensor_model_parallel_size,
        "actor_config.pipeline_model_parallel_size": actor.pipeline_model_parallel_size,
        "actor_config.expert_model_parallel_size": actor.expert_model_parallel_size,
        "rl_config.n_samples_per_prompt": rl.n_samples_per_prompt,
        "rl_config.mini_batch_size": rl.mini_batch_size,
        "rl_config.epochs": rl.epochs,
        "rl_config.max_prompt_length": rl.max_prompt_length,
        "rl_config.actor_forward_micro_batch_size": rl.actor_forward_micro_batch_size,
        "rl_config.ref_forward_micro_batch_size": rl.ref_forward_micro_batch_size,
        "rl_config.transfer_dock_timeout_s": rl.transfer_dock_timeout_s,
        "rl_config.collective_timeout_s": rl.collective_timeout_s,
        "rl_config.startup_timeout_s": rl.startup_timeout_s,
        "rl_config.reward_timeout_s": rl.reward_timeout_s,
        "rl_config.reward_batch_timeout_s": rl.reward_batch_timeout_s,
        "rl_config.max_consecutive_skipped_steps": rl.max_consecutive_skipped_steps,
        "generate_config.infer_tensor_parallel_size": gen.infer_tensor_parallel_size,
        "generate_config.max_num_seqs": gen.max_num_seqs,
        "generate_config.max_model_len": gen.max_model_len,
        "generate_config.max_num_batched_tokens": gen.max_num_batched_tokens,
        "generate_config.resharding_bucket_mb": gen.resharding_bucket_mb,
        "generate_config.sampling_config.max_tokens": sampling.max_tokens,
        "actor_config.lr": actor.lr,
        "rl_config.clip_ratio": rl.clip_ratio,
        "rl_config.save_on_sigterm_grace_s": rl.save_on_sigterm_grace_s,
    }
    for key, value in positive.items():
        _require(value is None or value > 0, key, value, "must be greater than 0",
                 "use a positive value")
    non_negative = {
        "megatron_training.save_interval": mt.save_interval,
        "megatron_training.test_interval": mt.test_interval,
        "actor_config.min_lr": actor.min_lr,
        "actor_config.weight_decay": actor.weight_decay,
        "actor_config.clip_grad": actor.clip_grad,
        "rl_config.init_kl_coef": rl.init_kl_coef,
        "generate_config.sampling_config.temperature": sampling.temperature,
        "generate_config.sampling_config.min_tokens": sampling.min_tokens,
    }
    for key, value in non_negative.items():
        _require(value >= 0, key, value, "must not be negative", "use 0 or a positive value")
    unit_intervals = {  # key: (value, lower bound included, upper bound included)
        "actor_config.lr_warmup_fraction": (actor.lr_warmup_fraction, True, False),
        "actor_config.adam_beta1": (actor.adam_beta1, True, False),
        "actor_config.adam_beta2": (actor.adam_beta2, True, False),
        "generate_config.gpu_memory_utilization": (gen.gpu_memory_utilization, False, True),
        "generate_config.sampling_config.top_p": (sampling.top_p, False, True),
        "generate_config.sampling_config.min_p": (sampling.min_p, True, True),
    }
    for key, (value, lower_ok, upper_ok) in unit_intervals.items():
        ok = (0 < value or (lower_ok and value == 0)) and (value < 1 or (upper_ok and value == 1))
        interval = f"{'[' if lower_ok else '('}0, 1{']' if upper_ok else ')'}"
        _require(ok, key, value, f"must lie in {interval}", f"use a value in {interval}")
    _require(actor.min_lr <= actor.lr, "actor_config.min_lr", actor.min_lr,
             f"exceeds actor_config.lr={actor.lr}", "set min_lr <= lr")
    _require(sampling.top_k >= -1, "generate_config.sampling_config.top_k", sampling.top_k,
             "must be -1 (off) or a positive number of tokens", "use -1 to disable top-k")
    _require(mt.test_interval == 0 or mt.test_data_path is not None,
             "megatron_training.test_interval", mt.test_interval,
             "evaluation is enabled but megatron_training.test_data_path is not set",
             "set test_data_path, or test_interval: 0")


def _check_algorithm(config: RLJobConfig) -> None:
    mt, rl, sampling = config.megatron_training, config.rl_config, config.sampling_config
    tp = config.actor_config.tensor_model_parallel_size
    _require(not mt.sequence_parallel or tp > 1, "megatron_training.sequence_parallel", True,
             f"needs actor_config.tensor_model_parallel_size > 1 (got {tp})",
             "set sequence_parallel: false or raise tensor_model_parallel_size")
    n, least = rl.n_samples_per_prompt, registry.estimator(rl.adv_estimator).min_group_size
    _require(n >= least, "rl_config.n_samples_per_prompt", n,
             f"{rl.adv_estimator} advantages compare the responses of one prompt, so a group "
             f"needs at least {least}", f"use n_samples_per_prompt >= {least} (e.g. 8)")
    _require(sampling.temperature > 0 or n == 1, "generate_config.sampling_config.temperature",
             sampling.temperature, f"greedy sampling (0) makes all {n} responses of a prompt "
             "identical, so the group has no signal", "use a temperature > 0, e.g. 1.0")
    _require(len(rl.verifier_function) > 0 or config.reward_config is not None,
             "rl_config.verifier_function", rl.verifier_function,
             "no reward would be computed (no verifier and no reward_config)",
             "name at least one verifier, e.g. [math_answer], or add a reward model")
    _require(len(rl.verifier_weight) == len(rl.verifier_function), "rl_config.verifier_weight",
             rl.verifier_weight, f"has {len(rl.verifier_weight)} weights for "
             f"{len(rl.verifier_function)} verifier_function entries {list(rl.verifier_function)}",
             "give one weight per verifier_function entry")
    gbs, mini = mt.global_batch_size, rl.mini_batch_size
    _require(gbs % mini == 0, "rl_config.mini_batch_size", mini,
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
        _require(rl.critic_warmup < train_iters, "rl_config.critic_warmup", rl.critic_warmup,
                 f"must be smaller than megatron_training.train_iters={train_iters}, or the "
                 "actor never updates", f"use at most {train_iters - 1}")
        _require(rl.critic_warmup >= 0, "rl_config.critic_warmup", rl.critic_warmup,
                 "must not be negative", "use 0 (no warmup) or a positive number of iterations")
        for key, value in (("rl_config.gamma", rl.gamma), ("rl_config.lam", rl.lam)):
            _require(0 <= value <= 1, key, value, "must lie in [0, 1]", "use a value in [0, 1]")
        _require(rl.cliprange_value > 0, "rl_config.cliprange_value", rl.cliprange_value,
                 "must be greater than 0", "use e.g. 0.5")
        _check_kl_in_reward(rl)
    else:
        if critic is not None:
            raise ConfigError("critic_config", f"{family.launcher} trains no critic "
                              f"({family.name.upper()}'s advantages come from the group or the "
                              "batch)", "remove the section, or launch "
                              f"{_launcher_building(CRITIC)}")
        if estimator.kl_in_reward:
            _require(0 <= rl.gamma <= 1, "rl_config.gamma", rl.gamma, "must lie in [0, 1]",
                     "use a value in [0, 1]")
            _check_kl_in_reward(rl)
        else:
            takers = [e.name for e in registry.estimators(family.name) if e.kl_in_reward]
            _require(not rl.use_kl_in_reward, "rl_config.use_kl_in_reward", True,
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
            _require(value is None or value == actor_value, f"{name}.{size}", value,
                     f"differs from actor_config.{size}={actor_value}: every role shares the "
                     "actor's training layout on the same ranks (co-located SPMD)",
                     f"set it to {actor_value} or leave it out")
        _require(section.micro_batch_size > 0, f"{name}.micro_batch_size",
                 section.micro_batch_size, "must be greater than 0", "use a positive value")
    if critic is not None:
        _require(critic.lr > 0, "critic_config.lr", critic.lr, "must be greater than 0",
                 "use e.g. 5e-6")
        _require(critic.value_head_init_std is None or critic.value_head_init_std >= 0,
                 "critic_config.value_head_init_std", critic.value_head_init_std,
                 "must not be negative", "use 0, a small std such as 0.02, or null")
        _require(critic.min_lr <= critic.lr, "critic_config.min_lr", critic.min_lr,
                 f"exceeds critic_config.lr={critic.lr}", "set min_lr <= lr")
    _require(rl.critic_forward_micro_batch_size > 0, "rl_config.critic_forward_micro_batch_size",
             rl.critic_forward_micro_batch_size, "must be greater than 0", "use a positive value")
    if reward is not None:
        _require(reward.weight != 0, "reward_config.weight", reward.weight,
                 "a reward model with weight 0 only costs time", "give it a non-zero weight, or "
                 "remove reward_config")


def _check_kl_in_reward(rl) -> None:
    """The KL controller's keys, read when the KL goes into the per-token reward."""
    _require(rl.kl_ctrl_type == "fixed" or rl.use_kl_in_reward, "rl_config.kl_ctrl_type",
             rl.kl_ctrl_type, "the adaptive KL controller scales the KL in the reward, but "
             "rl_config.use_kl_in_reward is false", "set use_kl_in_reward: true, or "
             "kl_ctrl_type: fixed")
    _require(rl.kl_horizon > 0 and rl.kl_target > 0, "rl_config.kl_horizon", rl.kl_horizon,
             "kl_horizon and kl_target must be greater than 0", "use e.g. kl_horizon: 10000, "
             "kl_target: 0.1")


def _launcher_building(role: str) -> str:
    """The launcher of the first family that builds ``role``."""
    return next(a.launcher for a in registry.algorithms() if role in a.builds)


def _runs(config: RLJobConfig, feature: str) -> bool:
    """Whether the job's family is built for ``feature`` (its rows, its phases)."""
    return feature in registry.algorithm(config.algorithm).supports


def _check_rollout_correction(config: RLJobConfig) -> None:
    """verl's rollout-correction keys: each threshold pair in order, nothing set that its
    switch leaves unused."""
    rl = config.rl_config
    upper = 2.0 if rl.rollout_is_threshold is None else rl.rollout_is_threshold
    for key in ("rollout_is_threshold_lower", "rollout_is_batch_normalize"):
        _require(not getattr(rl, key) or rl.rollout_is is not None, f"rl_config.{key}",
                 getattr(rl, key), "only acts on rollout_is weights, and rollout_is is null",
                 "set rollout_is: token or sequence, or remove the key")
    low = rl.rollout_is_threshold_lower
    _require(low is None or 0 <= low < upper, "rl_config.rollout_is_threshold_lower", low,
             f"must lie in [0, rollout_is_threshold={upper}): lower >= upper truncates every "
             "weight to one value", f"use e.g. {upper / 4:g}, or null")
    rs, rs_up, rs_low = rl.rollout_rs, rl.rollout_rs_threshold, rl.rollout_rs_threshold_lower
    for key, value in (("rollout_rs_threshold", rs_up), ("rollout_rs_threshold_lower", rs_low)):
        _require(value is None or rs is not None, f"rl_config.{key}", value,
                 "bounds the band of rollout_rs, and rollout_rs is null",
                 "set rollout_rs: token, sequence or geometric, or remove the key")
    if rs is not None:
        _require(rs_up is not None and rs_up > 0, "rl_config.rollout_rs_threshold", rs_up,
                 f"rollout_rs={rs} needs a positive upper bound of the kept ratio",
                 "use e.g. 2.0 (IcePop's band is 0.5 .. 2.0)")
        lower = 1.0 / rs_up if rs_low is None else rs_low
        _require(0 <= lower < rs_up, "rl_config.rollout_rs_threshold_lower", rs_low,
                 f"must lie in [0, rollout_rs_threshold={rs_up}): with lower >= upper every "
                 "token is rejected", f"use e.g. {1.0 / rs_up:g}, or null (1 / upper)")
    veto = rl.rollout_token_veto_threshold
    _require(veto is None or 0 < veto < 1, "rl_config.rollout_token_veto_threshold", veto,
             "must lie in (0, 1): a token ratio below it vetoes its sequence",
             "use e.g. 1e-4, or null")
    lag = rl.max_weight_version_lag
    _require(lag is None or lag >= 0, "rl_config.max_weight_version_lag", lag,
             "must be >= 0 (versions a trained token's weights may lag the trained ones)",
             "use e.g. 1 for one-step off-policy, or null")
    mini = rl.mini_batch_size or config.megatron_training.global_batch_size
    steps = max(config.megatron_training.global_batch_size // max(mini, 1), 1) * rl.epochs
    _require(lag is None or lag >= steps - 1, "rl_config.max_weight_version_lag", lag,
             f"is below the {steps - 1} versions the last of the iteration's {steps} optimizer "
             "steps (global_batch_size / mini_batch_size x epochs) lags its own fresh rows: "
             "every iteration would drop them", f"use at least {steps - 1}, or fewer "
             "optimizer steps per iteration")


def _check_router_replay(config: RLJobConfig) -> None:
    """MoE routing replay: a MoE model, and a layout and platform where the routes can be
    recorded and replayed (megatron-core's RouterReplay; R3 also vLLM's routers, in process)."""
    m, actor = config.model, config.actor_config
    mode = config.features.router_replay
    if mode is None:
        return
    _require(m.is_moe, "rl_config.router_replay", mode,
             f"replays the experts of a MoE model, and {m.model_type} has none",
             "set router_replay: none for a dense model")
    for key, value in (("pipeline_model_parallel_size", actor.pipeline_model_parallel_size),
                       ("context_parallel_size", actor.context_parallel_size)):
        _require(value == 1, "rl_config.router_replay", mode,
                 f"routes are laid out per micro-batch on one stage and one context-parallel "
                 f"rank here, and actor_config.{key}={value}",
                 f"set router_replay: none, or actor_config.{key}: 1")
    if config.features.replays_rollout_routing:
        from mindspeed_rl.platform.platform import detected_device_type

        device = detected_device_type()
        _require(device in ("cpu", "cuda"), "rl_config.router_replay", mode,
                 f"records vLLM's routed experts through vLLM's in-process routers "
                 f"(BaseRouter.set_capture_fn), which the {device} engine (vllm-ascend) does "
                 "not provide", "use router_replay: R2 (training-side replay) on this platform")
        _require(not config.generate_config.enable_prefix_caching,
                 "generate_config.enable_prefix_caching", True,
                 "router_replay: R3 records the experts of every prompt token as vLLM computes "
                 "them, and a cached prefix is not computed again",
                 "set enable_prefix_caching: false with router_replay: R3")


def _check_dapo(config: RLJobConfig) -> None:
    rl, sampling = config.rl_config, config.sampling_config
    low = rl.clip_ratio if rl.clip_ratio_low is None else rl.clip_ratio_low
    high = rl.clip_ratio if rl.clip_ratio_high is None else rl.clip_ratio_high
    _require(low > 0 and (low < 1 or rl.policy_loss == "gspo"), "rl_config.clip_ratio_low", low,
             "must lie in (0, 1)", "use e.g. 0.2")
    _require(high >= low, "rl_config.clip_ratio_high", high,
             f"is smaller than rl_config.clip_ratio_low={low}: clip-higher widens the upper "
             "side", f"use at least {low}, e.g. DAPO's 0.28 with 0.2")
    _require(rl.clip_ratio_c is None or rl.clip_ratio_c > 1, "rl_config.clip_ratio_c",
             rl.clip_ratio_c, "the dual-clip bound must be greater than 1", "use e.g. 3.0, or "
             "null")
    _require(rl.rollout_is_threshold is None or rl.rollout_is_threshold > 0,
             "rl_config.rollout_is_threshold", rl.rollout_is_threshold, "must be greater than 0",
             "use e.g. 2.0, or null")
    if rl.filter_groups_enable:
        _require(_runs(config, names.DYNAMIC_SAMPLING), "rl_config.filter_groups_enable", True,
                 "dynamic sampling filters GRPO groups (pretrain_grpo.py); PPO's advantages do "
                 "not vanish with equal rewards", "set filter_groups_enable: false")
        _require(rl.n_samples_per_prompt >= 2, "rl_config.filter_groups_enable", True,
                 f"with n_samples_per_prompt={rl.n_samples_per_prompt} every group has one "
                 "sample: none has a spread, so dynamic sampling would drop them all",
                 "use n_samples_per_prompt >= 2, or filter_groups_enable: false")
        metrics = ["reward", *rl.verifier_function]
        _require(rl.filter_groups_metric in metrics, "rl_config.filter_groups_metric",
                 rl.filter_groups_metric, "is neither reward nor one of "
                 f"rl_config.verifier_function {list(rl.verifier_function)}",
                 f"use one of {metrics}")
    _require(rl.gen_batch_size is None or rl.filter_groups_enable, "rl_config.gen_batch_size",
             rl.gen_batch_size, "sets the prompts of a dynamic-sampling round, but "
             "filter_groups_enable is off", "remove it, or set filter_groups_enable: true")
    _require(rl.gen_batch_size is None or rl.gen_batch_size > 0, "rl_config.gen_batch_size",
             rl.gen_batch_size, "must be greater than 0", "use a positive number of prompts")
    _require(rl.max_num_gen_batches >= 0, "rl_config.max_num_gen_batches",
             rl.max_num_gen_batches, "must not be negative", "use 0 (no limit) or a positive "
             "number of generation rounds")
    _require(0 <= rl.overlong_buffer_len < sampling.max_tokens, "rl_config.overlong_buffer_len",
             rl.overlong_buffer_len, f"must be in [0, generate_config.sampling_config.max_tokens="
             f"{sampling.max_tokens}) (the penalty starts at max_tokens - overlong_buffer_len)",
             f"use e.g. {sampling.max_tokens // 4}, or 0 to turn the penalty off")
    _require(rl.overlong_penalty_factor >= 0, "rl_config.overlong_penalty_factor",
             rl.overlong_penalty_factor, "must not be negative", "use e.g. 1.0")


def _check_lengths(config: RLJobConfig) -> None:
    mt, rl, gen, sampling = (config.megatron_training, config.rl_config, config.generate_config,
                             config.sampling_config)
    prompt, response = rl.max_prompt_length, config.features.response_limit
    total = prompt + response
    what = ("rl_config.max_total_response_length" if config.features.multi_turn
            else "generate_config.sampling_config.max_tokens")
    _require(total <= gen.max_model_len, what, response,
             f"rl_config.max_prompt_length={prompt} + {what.split('.')[-1]}={response} = {total} "
             "is larger "
             f"than generate_config.max_model_len={gen.max_model_len}",
             (f"lower max_tokens to at most {gen.max_model_len - prompt} or raise "
              if gen.max_model_len > prompt else "lower rl_config.max_prompt_length or raise ")
             + f"generate_config.max_model_len to at least {total}")
    # seq_length is the prompt data's length, as in MindSpeed-RL: a seq_length below
    # max_prompt_length cuts the longer prompts (the loader's warning says so).
    _require(mt.seq_length <= gen.max_model_len, "megatron_training.seq_length", mt.seq_length,
             f"exceeds generate_config.max_model_len={gen.max_model_len} (MindSpeed-RL checks "
             "the same)", f"use at most {gen.max_model_len}")
    if rl.use_dynamic_bsz:
        # The budget of each phase the job runs: its own key, else the base (as MindSpeed-RL
        # reads them); a role the algorithm does not build is not checked.
        for phase, prefix in packing_budgets(config).items():
            key = f"{prefix}max_packing_token_size" if getattr(
                rl, f"{prefix}max_packing_token_size") is not None else "max_packing_token_size"
            budget = getattr(rl, key)
            by = "" if key == f"{prefix}max_packing_token_size" else (
                f" (the {phase} phase's budget: rl_config.{prefix}max_packing_token_size is "
                "not set)")
            _require(budget >= total, f"rl_config.{key}", budget,
                     f"smaller than the longest single row{by}: rl_config.max_prompt_length="
                     f"{prompt} + {what}={response} = {total} tokens "
                     "(a micro-batch must hold at least one row)",
                     f"use at least {total} (MindSpeed-RL suggests twice that, {2 * total})")
        for prefix in ("", "update_", "actor_", "ref_"):
            key = f"{prefix}dynamic_max_batch_size"
            cap = getattr(rl, key)
            _require(cap is None or cap > 0, f"rl_config.{key}", cap, "must be greater than 0",
                     "use a positive row count, or null for no cap")
    limit = config.model.max_position_embeddings
    _require(limit is None or gen.max_model_len <= limit, "generate_config.max_model_len",
             gen.max_model_len, f"exceeds the model's max_position_embeddings={limit}",
             f"use at most {limit}")
    _require(sampling.min_tokens <= response, "generate_config.sampling_config.min_tokens",
             sampling.min_tokens, f"exceeds max_tokens={response}", "set min_tokens <= max_tokens")
    batched = gen.max_num_batched_tokens
    _require(batched is None or batched >= gen.max_num_seqs,
             "generate_config.max_num_batched_tokens", batched,
             f"smaller than generate_config.max_num_seqs={gen.max_num_seqs} (vLLM refuses this)",
             f"use at least {gen.max_num_seqs}, or null for vLLM's default")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, max(limit, 1)) + 1) if n % d == 0)


def check_data_files(config: RLJobConfig) -> None:
    """The data files exist and the output folders are writable (not needed, and not
    checked, by the dry-run)."""
    mt = config.megatron_training
    _require(mt.tokenizer_name_or_path is not None, "megatron_training.tokenizer_name_or_path",
             None, "not set, and the model names no tokenizer", "set it to the HF directory "
             "holding the tokenizer files")
    for key, value in (("megatron_training.data_path", mt.data_path),
                       ("megatron_training.test_data_path", mt.test_data_path)):
        if value is not None and not Path(value).exists() and not _indexed_prefix(value):
            raise ConfigError(key, "no such file, directory or indexed-dataset prefix",
                              "check the path (relative paths resolve against the current "
                              f"working directory, {os.getcwd()})", value=value)
    expert_map = config.generate_config.expert_map_path
    _require(expert_map is None or Path(expert_map).is_file(), "generate_config.expert_map_path",
             expert_map, "no such file", "check the path (relative paths resolve against the "
             f"current working directory, {os.getcwd()})")
    if config.features.multi_turn and mt.prompt_type is None:
        _require(_indexed_prefix(mt.data_path), "megatron_training.prompt_type", None,
                 f"multi_turn_enable with the raw prompts of {mt.data_path}: the tokenizer's "
                 "chat template alone does not tell the model its tools", "set prompt_type: "
                 f"{TOOL_PROMPT_TYPES[0]}, or train on data preprocessed with a tool template")
    check_output_dirs(config)
    check_tokenizer_fits(config)
    check_tool_sandbox(config)


def check_tool_sandbox(config: RLJobConfig) -> None:
    """The local code interpreter's sandbox runs on this machine (one call is run in it), or
    its tool opted out explicitly (a warning, once per run): never a silent downgrade."""
    rl = config.rl_config
    if not config.features.multi_turn or rl.tool_config_path is None:
        return
    from mindspeed_rl.agent_tools.config import load_tool_config
    from mindspeed_rl.agent_tools.preflight import local_interpreter_problem

    for spec in load_tool_config(rl.tool_config_path):
        if spec.kind != "code_interpreter":
            continue
        problem = local_interpreter_problem(spec, rl.tool_config_path)
        if problem is not None:
            raise ConfigError("rl_config.tool_config_path", problem, value=rl.tool_config_path)


def _check_training_features(config: RLJobConfig) -> None:
    from mindspeed_rl.parallel.layout import LayoutError, pipeline_stage_layers

    a, m = config.actor_config, config.model
    for key, value in (("actor_config.expert_tensor_parallel_size", a.expert_tensor_parallel_size),
                       ("actor_config.recompute_num_layers", a.recompute_num_layers)):
        _require(value is None or value > 0, key, value, "must be greater than 0",
                 "use a positive value or null")
    _require(a.moe_aux_loss_coeff >= 0, "actor_config.moe_aux_loss_coeff", a.moe_aux_loss_coeff,
             "must not be negative", "use 0 (none) or a small positive value, e.g. 0.001")
    _require(a.expert_tensor_parallel_size in (None, a.tensor_model_parallel_size) or m.is_moe,
             "actor_config.expert_tensor_parallel_size", a.expert_tensor_parallel_size,
             f"the model ({m.model_type}) has no experts", "remove it for dense models")
    _require(not a.finetune or a.load is not None, "actor_config.finetune", True,
             "needs actor_config.load (the checkpoint whose weights the run starts from)",
             "set load, or finetune: false")
    stages = [m.num_hidden_layers]
    if a.num_layer_list is not None:
        try:
            stages = pipeline_stage_layers(m.num_hidden_layers, a.pipeline_model_parallel_size,
                                           a.num_layer_list)
        except LayoutError as e:
            problem = re.sub(r"^num_layer_list=\S+:? ", "", str(e))
            raise ConfigError("actor_config.num_layer_list", problem,
                              "list one layer count per pipeline stage, adding up to the "
                              f"model's {m.num_hidden_layers} layers",
                              value=a.num_layer_list) from None
    granularity, method, n = a.recompute_granularity, a.recompute_method, a.recompute_num_layers
    if granularity is None:
        _require(method is None and n is None, "actor_config.recompute_method"
                 if method is not None else "actor_config.recompute_num_layers",
                 method if method is not None else n, "has no effect without "
                 "actor_config.recompute_granularity", "set recompute_granularity: full")
    elif granularity == "full":
        _require(method is not None, "actor_config.recompute_method", method,
                 "recompute_granularity full needs a method", "use uniform or block")
        _require(n is not None, "actor_config.recompute_num_layers", n,
                 "recompute_granularity full needs recompute_num_layers",
                 "e.g. recompute_num_layers: 1")
        if method == "block" and a.pipeline_model_parallel_size > 1 or method == "uniform":
            most = max(stages) if a.num_layer_list else -(
                -m.num_hidden_layers // a.pipeline_model_parallel_size)
            _require(n <= most, "actor_config.recompute_num_layers", n,
                     f"exceeds the {most} layers of a pipeline stage", f"use at most {most}")
    else:
        _require(method is None and n is None, "actor_config.recompute_method"
                 if method is not None else "actor_config.recompute_num_layers",
                 method if method is not None else n,
                 "recompute_granularity selective recomputes core attention of every layer",
                 "remove recompute_method and recompute_num_layers")


# megatron-core's names of the linears LoRA adapts (MindSpeed-RL's lora_target_modules)
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_HF_LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
               "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
               "down_proj": "linear_fc2"}


def _check_context_parallel(config: RLJobConfig) -> None:
    """Context parallelism's own keys (its divisibilities are the layout's: plan.py)."""
    a = config.actor_config
    _require(a.attention_mask_type == "causal", "actor_config.attention_mask_type",
             a.attention_mask_type, "only causal attention is built here (each packed row "
             "attends to its own earlier tokens)", "use attention_mask_type: causal")
    _require(a.context_parallel_size >= 1, "actor_config.context_parallel_size",
             a.context_parallel_size, "must be a positive integer", "use 1 (no context "
             "parallelism) or the number of ranks to split each sequence over")


def check_runnable(config: RLJobConfig) -> None:
    """What the dry run plans but a launch cannot run yet (checked before any process group):
    context parallelism runs the actor and the reference (engine/context_parallel.py), not
    the scalar-head models (PPO's critic, a reward model)."""
    cp = config.actor_config.context_parallel_size
    if cp == 1:
        return
    for section, what in (("critic_config", "PPO's critic"), ("reward_config", "a reward model")):
        _require(getattr(config, section) is None, "actor_config.context_parallel_size", cp,
                 f"context parallelism runs the policy and the reference here, not {what} "
                 f"({section})", f"launch with context_parallel_size: 1, or without {section}")


def _check_lora(config: RLJobConfig) -> None:
    """LoRA and the shared backbone: MindSpeed-RL's keys, refused before any process group."""
    a, rl, m = config.actor_config, config.rl_config, config.model
    targets = a.lora_target_modules
    _require(isinstance(a.lora_r, int) and a.lora_r > 0, "actor_config.lora_r", a.lora_r,
             "the LoRA rank must be a positive integer", "use e.g. 8, 16 or 64")
    _require(a.lora_alpha > 0, "actor_config.lora_alpha", a.lora_alpha,
             "must be greater than 0 (adapters add lora_alpha / lora_r * B A)",
             "use e.g. lora_r or 2 x lora_r")
    for name in targets:
        hf = _HF_LINEARS.get(name)
        _require(name in LORA_TARGET_MODULES, "actor_config.lora_target_modules", list(targets),
                 f"{name!r} is not a linear of the model ({m.model_type})",
                 (f"use megatron's name {hf!r}" if hf else "choose from "
                  f"{list(LORA_TARGET_MODULES)}"))
        _require(not (m.is_moe and name in ("linear_fc1", "linear_fc2")),
                 "actor_config.lora_target_modules", list(targets),
                 f"the model ({m.model_type}) has no dense {name}: its MLPs are experts, "
                 "which LoRA does not adapt here", "keep linear_qkv and linear_proj")
    _require(not (m.is_mla and targets), "actor_config.lora_target_modules", list(targets),
             f"LoRA is not built here for multi-latent attention ({m.model_type}): it has no "
             "linear_qkv, and its projections are not adapted", "remove lora_target_modules "
             "(full fine-tuning)")
    _require(len(set(targets)) == len(targets), "actor_config.lora_target_modules",
             list(targets), "names a module twice", "list each module once")
    _require(not a.lora_ckpt_filter or targets, "actor_config.lora_ckpt_filter", True,
             "saves only the LoRA adapters, but actor_config.lora_target_modules is empty "
             "(full fine-tuning has no adapters)", "set lora_target_modules, or "
             "lora_ckpt_filter: false")
    if not rl.share_backbone:
        return
    _require(bool(targets), "rl_config.share_backbone", True,
             "the shared backbone is the actor with its LoRA adapters switched off, but "
             "actor_config.lora_target_modules is empty", "set lora_target_modules, or "
             "share_backbone: false")
    _require(rl.init_kl_coef > 0, "rl_config.share_backbone", True,
             "this run has no reference model to share the backbone with (rl_config."
             f"init_kl_coef={rl.init_kl_coef}" + ("; DAPO trains without a KL term"
                                                  if rl.filter_groups_enable else "") + ")",
             "set share_backbone: false, or a KL term (init_kl_coef > 0)")
    _require(config.ref_config.load is None, "rl_config.share_backbone", True,
             f"the reference is the actor's own backbone, but ref_config.load="
             f"{config.ref_config.load} names other weights", "remove ref_config.load, or "
             "share_backbone: false")


def _check_generation_features(config: RLJobConfig) -> None:
    g, m = config.generate_config, config.model
    _require(g.infer_expert_parallel_size >= 1, "generate_config.infer_expert_parallel_size",
             g.infer_expert_parallel_size, "must be at least 1", "use 1 (no expert parallelism)")
    _require(g.infer_expert_parallel_size == 1 or g.enable_expert_parallel,
             "generate_config.infer_expert_parallel_size", g.infer_expert_parallel_size,
             "needs generate_config.enable_expert_parallel: true",
             "enable it, or set infer_expert_parallel_size: 1")
    _require(not g.enable_expert_parallel or m.is_moe, "generate_config.enable_expert_parallel",
             True, f"the model ({m.model_type}) has no experts", "set it to false")
    _require(g.expert_map_path is None or g.enable_expert_parallel,
             "generate_config.expert_map_path", g.expert_map_path, "places experts on vLLM's "
             "expert-parallel ranks, but generate_config.enable_expert_parallel is false",
             "set enable_expert_parallel: true (a MoE model), or remove expert_map_path")


def _check_partial_rollout(config: RLJobConfig) -> None:
    rl, max_tokens = config.rl_config, config.sampling_config.max_tokens
    split = rl.partial_rollout_max_split
    key = "rl_config.partial_rollout_max_split"
    _require(split >= 1, key, split, "must be at least 1 (1 = off, N > 1: every response is "
             "complete within N rollout passes)", "use 1, or e.g. 2")
    _require(split <= max_tokens, key, split, f"exceeds generate_config.sampling_config."
             f"max_tokens={max_tokens}: a rollout pass would generate less than one token",
             f"use at most {max_tokens}, e.g. 2 or 4")
    if config.features.partial_rollout:
        _require(_runs(config, "partial_rollout"), key, split,
                 "partial rollout runs with GRPO and DAPO (pretrain_grpo.py), as in "
                 "MindSpeed-RL; PPO's critic and GAE are not built for rows that span "
                 "iterations", "set partial_rollout_max_split: 1 for PPO")
        _require(config.sampling_config.temperature > 0 or rl.n_samples_per_prompt == 1, key,
                 split, "greedy sampling with n_samples_per_prompt > 1 cannot form a group",
                 "raise generate_config.sampling_config.temperature")


TOOL_PROMPT_TYPES = ("qwen_retool",)  # prompt types whose template describes the tools


def _check_multi_turn(config: RLJobConfig) -> None:
    rl, key = config.rl_config, "rl_config.multi_turn_enable"
    _require(rl.max_tool_response_length > 0, "rl_config.max_tool_response_length",
             rl.max_tool_response_length, "must be positive (characters of a tool response "
             "kept)", "use e.g. 256")
    if not config.features.multi_turn:
        return
    _require(_runs(config, "multi_turn"), key, True, "multi-turn rollouts run with GRPO and "
             "DAPO (pretrain_grpo.py), as in MindSpeed-RL; PPO's critic and GAE are not built "
             "for responses with tool tokens", "set multi_turn_enable: false for PPO")
    estimator = registry.estimator(rl.adv_estimator)
    sequence_level = [e.name for e in registry.estimators(config.algorithm) if e.whole_groups]
    _require(estimator.whole_groups, "rl_config.adv_estimator", rl.adv_estimator,
             "its per-token returns are not built for responses with tool tokens inside "
             "(multi_turn_enable)", f"use one of {sequence_level} with multi_turn_enable")
    _require(rl.tool_config_path is not None, "rl_config.tool_config_path", None,
             "multi_turn_enable needs the tool YAML", "e.g. configs/tools/code_interpreter.yaml")
    # null: MindSpeed-RL's configs leave it to their preprocessed (indexed) data, whose
    # prompts were rendered with qwen_retool; check_data_files refuses null on raw prompts.
    _require(config.megatron_training.prompt_type in TOOL_PROMPT_TYPES + (None,),
             "megatron_training.prompt_type", config.megatron_training.prompt_type,
             "has no tool template: the model would not be told which tools it can call or "
             "how", f"use one of {list(TOOL_PROMPT_TYPES)} with multi_turn_enable")
    _require(rl.max_tool_calls >= 0, "rl_config.max_tool_calls", rl.max_tool_calls,
             "must be at least 0", "use e.g. 1")
    _require(rl.max_parallel_calls >= 1, "rl_config.max_parallel_calls", rl.max_parallel_calls,
             "must be at least 1", "use e.g. 1")
    max_tokens = config.sampling_config.max_tokens
    _require(config.features.response_limit >= max_tokens, "rl_config.max_total_response_length",
             rl.max_total_response_length, f"is smaller than generate_config.sampling_config."
             f"max_tokens={max_tokens} (MindSpeed-RL refuses the same)",
             f"use at least {max_tokens}")
    from mindspeed_rl.agent_tools.config import ToolConfigError, load_tool_config
    from mindspeed_rl.agent_tools.parser import tool_parser

    try:
        tool_parser(rl.tool_parser_format)
    except ValueError as e:
        raise ConfigError("rl_config.tool_parser_format", str(e),
                          value=rl.tool_parser_format) from None

    try:
        load_tool_config(rl.tool_config_path)
    except ToolConfigError as e:
        raise ConfigError("rl_config.tool_config_path", str(e), "fix the tool YAML "
                          "(docs/tools.md)", value=rl.tool_config_path) from None


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
    _require(rl.reward_workers is None or rl.reward_workers >= 0, "rl_config.reward_workers",
             rl.reward_workers, "must not be negative",
             "use 0 (score in the training process), a number of processes, or null (auto)")
    # The other ranks wait for this rank's rewards in the next collective.
    _require(rl.reward_batch_timeout_s is None
             or rl.reward_batch_timeout_s < rl.collective_timeout_s,
             "rl_config.reward_batch_timeout_s", rl.reward_batch_timeout_s,
             f"is not below rl_config.collective_timeout_s={rl.collective_timeout_s} (the other "
             "ranks would give up on this one first)",
             "lower it, or set null (half of collective_timeout_s)")


def _indexed_prefix(path: str) -> bool:
    """A MindSpeed-RL packed indexed dataset prefix (P_packed_input_ids_document.idx)."""
    return Path(f"{path}_packed_input_ids_document.idx").is_file()


def check_output_dirs(config: RLJobConfig) -> None:
    """``log_dir`` and ``save`` can be written (checked before any rank starts work, so a
    bad path fails at once on every rank instead of on rank 0 mid-run).

    Nothing is created: the nearest existing folder must be a directory where a file
    can be made (a probe file is created and removed at once, which also catches
    read-only file systems and immutable folders, where permission bits say nothing).
    """
    import tempfile

    for key, value in (("megatron_training.log_dir", config.megatron_training.log_dir),
                       ("actor_config.save", config.actor_config.save)):
        if not value:
            continue
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise ConfigError(key, "exists and is not a directory",
                              "point it to a directory, or move the file away", value=value)
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(key, f"cannot be created: {existing} is a file",
                              "point it below a directory", value=value)
        try:
            fd, probe = tempfile.mkstemp(prefix=".mindspeed_rl_probe_", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ConfigError(key, f"cannot write in {existing} ({exc.strerror})",
                              "choose a writable directory", value=value) from None


def check_tokenizer_fits(config: RLJobConfig) -> None:
    """Every token id of the tokenizer has a row in the model's embedding (a local tokenizer
    only; a hub id is checked when it is loaded)."""
    mt, model = config.megatron_training, config.model
    source = mt.tokenizer_name_or_path or model.hf_dir
    own = model.hf_dir is not None and Path(source) == Path(model.hf_dir)  # the model's own
    key = "megatron_training.model" if own else "megatron_training.tokenizer_name_or_path"
    if not source or not Path(source).is_dir():
        return
    from transformers import AutoTokenizer

    try:
        num_tokens = len(AutoTokenizer.from_pretrained(source))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; name the folder
        raise ConfigError(key, f"the tokenizer in {source} cannot be loaded ({exc})",
                          "point it to a folder with tokenizer.json or tokenizer_config.json",
                          value=source) from None
    if num_tokens > model.vocab_size:
        raise ConfigError(
            key, f"the tokenizer in {source} has {num_tokens} tokens but the model's "
            f"vocab_size is {model.vocab_size} ({model.source}): ids >= {model.vocab_size} "
            "have no embedding", "use the tokenizer the model was trained with, or a model "
            "whose vocab_size covers it", value=source)
