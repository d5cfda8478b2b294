"""Checks of the training side's features: expert tensor parallelism, the MoE auxiliary
loss, ``finetune``, uneven pipeline stages (``num_layer_list``), activation recompute,
context parallelism and LoRA (with the shared backbone); and `check_runnable`, what the dry
run plans but a launch cannot run yet.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import ConfigError, require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig

# megatron-core's names of the linears LoRA adapts (MindSpeed-RL's lora_target_modules)
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_HF_LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
               "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
               "down_proj": "linear_fc2"}


def check_training_features(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first training feature set up wrong: the expert and
    recompute keys, pipeline stages, context parallelism, LoRA."""
    _check_training_keys(config)
    _check_context_parallel(config)
    _check_lora(config)


def _check_training_keys(config: RLJobConfig) -> None:
    from mindspeed_rl.parallel.layout import LayoutError, pipeline_stage_layers

    a, m = config.actor_config, config.model
    for key, value in (("actor_config.expert_tensor_parallel_size", a.expert_tensor_parallel_size),
                       ("actor_config.recompute_num_layers", a.recompute_num_layers)):
        require(value is None or value > 0, key, value, "must be greater than 0",
                "use a positive value or null")
    require(a.moe_aux_loss_coeff >= 0, "actor_config.moe_aux_loss_coeff", a.moe_aux_loss_coeff,
            "must not be negative", "use 0 (none) or a small positive value, e.g. 0.001")
    require(a.expert_tensor_parallel_size in (None, a.tensor_model_parallel_size) or m.is_moe,
            "actor_config.expert_tensor_parallel_size", a.expert_tensor_parallel_size,
            f"the model ({m.model_type}) has no experts", "remove it for dense models")
    require(not a.finetune or a.load is not None, "actor_config.finetune", True,
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
        require(method is None and n is None, "actor_config.recompute_method"
                if method is not None else "actor_config.recompute_num_layers",
                method if method is not None else n, "has no effect without "
                "actor_config.recompute_granularity", "set recompute_granularity: full")
    elif granularity == "full":
        require(method is not None, "actor_config.recompute_method", method,
                "recompute_granularity full needs a method", "use uniform or block")
        require(n is not None, "actor_config.recompute_num_layers", n,
                "recompute_granularity full needs recompute_num_layers",
                "e.g. recompute_num_layers: 1")
        if method == "block" and a.pipeline_model_parallel_size > 1 or method == "uniform":
            most = max(stages) if a.num_layer_list else -(
                -m.num_hidden_layers // a.pipeline_model_parallel_size)
            require(n <= most, "actor_config.recompute_num_layers", n,
                    f"exceeds the {most} layers of a pipeline stage", f"use at most {most}")
    else:
        require(method is None and n is None, "actor_config.recompute_method"
                if method is not None else "actor_config.recompute_num_layers",
                method if method is not None else n,
                "recompute_granularity selective recomputes core attention of every layer",
                "remove recompute_method and recompute_num_layers")


def _check_context_parallel(config: RLJobConfig) -> None:
    """Context parallelism's own keys (its divisibilities are the layout's: plan.py)."""
    a = config.actor_config
    # MindSpeed reads it only for its context-parallel attention: general (a mask given
    # with the data) changes nothing without context parallelism.
    require(a.attention_mask_type in ("causal", "general") and (
        a.attention_mask_type == "causal" or a.context_parallel_size == 1),
            "actor_config.attention_mask_type", a.attention_mask_type,
            "only causal attention is built here under context parallelism (each packed row "
            "attends to its own earlier tokens)", "use attention_mask_type: causal")
    require(a.context_parallel_size >= 1, "actor_config.context_parallel_size",
            a.context_parallel_size, "must be a positive integer", "use 1 (no context "
            "parallelism) or the number of ranks to split each sequence over")


def _check_lora(config: RLJobConfig) -> None:
    """LoRA and the shared backbone: MindSpeed-RL's keys, refused before any process group."""
    a, rl, m = config.actor_config, config.rl_config, config.model
    targets = a.lora_target_modules
    require(isinstance(a.lora_r, int) and a.lora_r > 0, "actor_config.lora_r", a.lora_r,
            "the LoRA rank must be a positive integer", "use e.g. 8, 16 or 64")
    require(a.lora_alpha > 0, "actor_config.lora_alpha", a.lora_alpha,
            "must be greater than 0 (adapters add lora_alpha / lora_r * B A)",
            "use e.g. lora_r or 2 x lora_r")
    for name in targets:
        hf = _HF_LINEARS.get(name)
        require(name in LORA_TARGET_MODULES, "actor_config.lora_target_modules", list(targets),
                f"{name!r} is not a linear of the model ({m.model_type})",
                (f"use megatron's name {hf!r}" if hf else "choose from "
                 f"{list(LORA_TARGET_MODULES)}"))
        require(not (m.is_moe and name in ("linear_fc1", "linear_fc2")),
                "actor_config.lora_target_modules", list(targets),
                f"the model ({m.model_type}) has no dense {name}: its MLPs are experts, "
                "which LoRA does not adapt here", "keep linear_qkv and linear_proj")
    require(not (m.is_mla and targets), "actor_config.lora_target_modules", list(targets),
            f"LoRA is not built here for multi-latent attention ({m.model_type}): it has no "
            "linear_qkv, and its projections are not adapted", "remove lora_target_modules "
            "(full fine-tuning)")
    require(len(set(targets)) == len(targets), "actor_config.lora_target_modules",
            list(targets), "names a module twice", "list each module once")
    require(not a.lora_ckpt_filter or targets, "actor_config.lora_ckpt_filter", True,
            "saves only the LoRA adapters, but actor_config.lora_target_modules is empty "
            "(full fine-tuning has no adapters)", "set lora_target_modules, or "
            "lora_ckpt_filter: false")
    if not rl.share_backbone:
        return
    require(bool(targets), "rl_config.share_backbone", True,
            "the shared backbone is the actor with its LoRA adapters switched off, but "
            "actor_config.lora_target_modules is empty", "set lora_target_modules, or "
            "share_backbone: false")
    require(rl.init_kl_coef > 0, "rl_config.share_backbone", True,
            "this run has no reference model to share the backbone with (rl_config."
            f"init_kl_coef={rl.init_kl_coef}" + ("; DAPO trains without a KL term"
                                                 if config.features.dynamic_sampling else "")
            + ")",
            "set share_backbone: false, or a KL term (init_kl_coef > 0)")
    require(config.ref_config.load is None, "rl_config.share_backbone", True,
            f"the reference is the actor's own backbone, but ref_config.load="
            f"{config.ref_config.load} names other weights", "remove ref_config.load, or "
            "share_backbone: false")


def check_runnable(config: RLJobConfig) -> None:
    """What the dry run plans but a launch cannot run yet (checked before any process group):
    context parallelism runs the actor and the reference (engine/cp_micro_batch.py), not
    the scalar-head models (PPO's critic, a reward model)."""
    cp = config.actor_config.context_parallel_size
    if cp == 1:
        return
    for section, what in (("critic_config", "PPO's critic"), ("reward_config", "a reward model")):
        require(getattr(config, section) is None, "actor_config.context_parallel_size", cp,
                f"context parallelism runs the policy and the reference here, not {what} "
                f"({section})", f"launch with context_parallel_size: 1, or without {section}")
