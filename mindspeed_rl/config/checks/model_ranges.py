"""Checks of the model's numbers and of every key's range.

The model's architecture fields are positive and agree with each other (heads, KV heads,
experts; DeepSeek-V3's routing: `config/deepseek_checks.py`); every size, count, rate and
timeout of the job lies in its range (positive, non-negative, in [0, 1]).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mindspeed_rl.config.deepseek_checks import routing_problems
from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_model_ranges(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first model number, or key, out of its range."""
    _check_model(config)
    _check_ranges(config)


def _check_model(config: RLJobConfig) -> None:
    m = config.model
    where = f"(in {m.source})"
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "vocab_size", "num_key_value_heads", "head_dim", "num_experts",
                 "moe_intermediate_size", "num_experts_per_tok", "max_position_embeddings"):
        value = getattr(m, name)
        require(value is None or value > 0, f"model.{name}", value, f"must be positive {where}",
                "copy the value from the model's config.json")
    if m.head_dim is None:
        require(m.hidden_size % m.num_attention_heads == 0, "model.hidden_size", m.hidden_size,
                f"not divisible by num_attention_heads={m.num_attention_heads} {where}",
                "set head_dim explicitly")
    require(m.num_attention_heads % m.num_kv_heads == 0, "model.num_key_value_heads",
            m.num_kv_heads, f"does not divide num_attention_heads={m.num_attention_heads} "
            f"{where}", "copy both from the model's config.json")
    if m.is_moe:
        require(m.moe_intermediate_size is not None, "model.moe_intermediate_size", None,
                f"required when num_experts is set {where}", "copy it from config.json")
        require(m.num_experts_per_tok is None or m.num_experts_per_tok <= m.num_experts,
                "model.num_experts_per_tok", m.num_experts_per_tok,
                f"exceeds num_experts={m.num_experts} {where}", "copy it from config.json")
    if m.is_mla:
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
        problems = routing_problems(fields, lambda name: f"model.{name}")
        if problems:
            raise problems[0]
    ep = config.actor_config.expert_model_parallel_size
    require(ep == 1 or m.is_moe, "actor_config.expert_model_parallel_size", ep,
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
        "generate_config.block_size": gen.block_size,
        "generate_config.resharding_bucket_mb": gen.resharding_bucket_mb,
        "generate_config.sampling_config.max_tokens": sampling.max_tokens,
        "actor_config.lr": actor.lr,
        "rl_config.clip_ratio": rl.clip_ratio,
        "rl_config.save_on_sigterm_grace_s": rl.save_on_sigterm_grace_s,
    }
    for key, value in positive.items():
        require(value is None or value > 0, key, value, "must be greater than 0",
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
        require(value >= 0, key, value, "must not be negative", "use 0 or a positive value")
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
        require(ok, key, value, f"must lie in {interval}", f"use a value in {interval}")
    require(actor.min_lr <= actor.lr, "actor_config.min_lr", actor.min_lr,
            f"exceeds actor_config.lr={actor.lr}", "set min_lr <= lr")
    require(sampling.top_k >= -1, "generate_config.sampling_config.top_k", sampling.top_k,
            "must be -1 (off) or a positive number of tokens", "use -1 to disable top-k")
    require(mt.test_interval == 0 or mt.test_data_path is not None,
            "megatron_training.test_interval", mt.test_interval,
            "evaluation is enabled but megatron_training.test_data_path is not set",
            "set test_data_path, or test_interval: 0")
