"""MindSpeed-RL's model yamls: Megatron argument names nested under the model name.

    qwen25_7b:                 # configs/model/qwen25_7b.yaml, chosen by `defaults: - model:`
      num_layers: 28
      hidden_size: 3584
      ffn_hidden_size: 18944
      num_query_groups: 4
      padded_vocab_size: 152064
      ...

`translate_megatron_model` rewrites such a body into the Hugging Face field names of
`ModelSpec` (DeepSeek-V3's keys: `deepseek_model_yaml`). Keys that describe an architecture
this project does not build (Llama-3 RoPE scaling, shared experts without multi-latent
attention...) are errors; kernel choices are accepted.
"""

from __future__ import annotations

from typing import Any

from mindspeed_rl.config.deepseek_model_yaml import (DEEPSEEK_KEYS, deepseek_fields, is_mla,
                                                     plain_model_problems)
from mindspeed_rl.config.config_error import ConfigError, ConfigErrors, show_value
from mindspeed_rl.config.mindspeed_keys import (HONOURED, MEGATRON, NOT_APPLICABLE,
                                                not_applicable_error, row, typo_hint)

# Megatron name -> HF config.json name (same value).
_RENAMED = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size", "num_attention_heads": "num_attention_heads",
    "kv_channels": "head_dim", "padded_vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings", "rotary_base": "rope_theta",
    "norm_epsilon": "rms_norm_eps", "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size", "moe_router_topk": "num_experts_per_tok",
    # the experts' hidden size under its older name (MindSpeed-RL 2.0.0 to 2.2.0)
    "moe_intermediate_size": "moe_intermediate_size",
}
MEGATRON_TO_HF = _RENAMED
# Keys whose value must be this (or absent): the architectures built here.
_REQUIRED = {
    "position_embedding_type": ("rope",), "normalization": ("RMSNorm",), "swiglu": (True,),
    "disable_bias_linear": (True,), "use_mcore_models": (True,),
    "make_vocab_size_divisible_by": (1,),
    # RoPE scaling other than DeepSeek-V3's YaRN is not built here
    **{key: (None,) for key in ("low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")},
}
# Kernel and implementation choices with no effect on the function computed.
_IGNORED = frozenset({
    "spec", "use_rotary_position_embeddings", "attention_softmax_in_fp32", "moe_grouped_gemm",
    "moe_permutation_async_comm", "moe_token_dispatcher_type",
    "use_fused_moe_token_permute_and_unpermute", "no_gradient_accumulation_fusion",
    "group_query_attention",
})
# Training settings a model yaml may carry: they become these job keys unless the job sets them
# (so does any other key the job sections honour, as MindSpeed-RL merges the two).
TRAINING_SETTINGS = {"moe_aux_loss_coeff": "actor_config.moe_aux_loss_coeff"}
_OTHER = {"num_query_groups", "untie_embeddings_and_output_weights", "add_qkv_bias",
          "attention_bias", "qk_layernorm"}


def is_megatron_model_yaml(raw: Any, name: str | None = None) -> bool:
    """A single top-level key holding a mapping: MindSpeed-RL's ``<name>: {...}`` layout."""
    return (isinstance(raw, dict) and len(raw) == 1 and isinstance(next(iter(raw.values())), dict)
            and (name is None or next(iter(raw)) == name) and "model_type" not in raw)


def translate_megatron_model(raw: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(HF fields for ModelSpec, job settings)`` of a MindSpeed-RL model yaml.

    Raises:
        ConfigErrors: every key that is unknown or names an unsupported architecture.
    """
    (name, body), = raw.items()
    problems: list[ConfigError] = []
    hf: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    mla = is_mla(body)
    for key, value in body.items():
        dotted = f"{name}.{key}"
        if key in DEEPSEEK_KEYS:
            continue                     # deepseek_fields / plain_model_problems read them
        if key in _RENAMED:
            hf[_RENAMED[key]] = value
        elif key in _REQUIRED:
            if not any(value == ok and type(value) is type(ok) or value is ok
                       for ok in _REQUIRED[key]):
                problems.append(ConfigError(dotted, f"is an architecture not built here "
                                            f"(in {where})", "supported: "
                                            f"{' or '.join(map(show_value, _REQUIRED[key]))}",
                                            value=value))
        elif key in TRAINING_SETTINGS:
            settings[TRAINING_SETTINGS[key]] = value
        elif key in _IGNORED or key in _OTHER:
            continue
        elif row(MEGATRON, key) is not None:
            # MindSpeed-RL merges the model yaml into the job's Megatron settings (the job's
            # sections win), so any Megatron key may sit here.
            r = row(MEGATRON, key)
            if r.handling == HONOURED:
                settings[r.detail] = value
            elif r.handling != NOT_APPLICABLE:
                problems.append(ConfigError(dotted, f"a job key in a model yaml (in {where})",
                                            "write it in the job's megatron_training",
                                            value=value))
            elif not r.accepts(value):
                problems.append(not_applicable_error(dotted, value, r))
        else:
            candidates = list(_RENAMED) + list(_REQUIRED) + list(_IGNORED) + list(_OTHER) + list(
                TRAINING_SETTINGS) + sorted(DEEPSEEK_KEYS)
            problems.append(ConfigError(dotted, f"unknown model-yaml key (in {where})",
                                        typo_hint(key, candidates, f"{name}.")
                                        or "see docs/config.md (MindSpeed-RL model yamls)"))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "padded_vocab_size"):
        if key not in body:
            problems.append(ConfigError(f"{name}.{key}", f"required key is missing (in {where})",
                                        "copy it from the model's MindSpeed-LLM yaml or "
                                        "config.json"))
    if mla:
        deepseek, more = deepseek_fields(body, name, where)
        problems += more
    else:
        problems += plain_model_problems(body, name, where)
    if problems:
        raise ConfigErrors(problems, where)
    hf["tie_word_embeddings"] = not body.get("untie_embeddings_and_output_weights", False)
    hf.setdefault("rms_norm_eps", 1e-5)   # Megatron's norm_epsilon default
    if mla:
        hf.pop("num_experts", None)         # DeepseekV3Config's name: n_routed_experts
        hf.update(deepseek)
    else:
        hf.update(_plain_fields(body, name, where))
    return hf, settings


def _plain_fields(body: dict, name: str, where: str) -> dict[str, Any]:
    """KV heads, biases and the model type of a yaml without multi-latent attention:
    Qwen3-MoE with experts, Qwen3 with qk_layernorm, Qwen2 with q/k/v biases, else Llama."""
    heads = body["num_attention_heads"]
    hf: dict[str, Any] = {"num_key_value_heads": body.get("num_query_groups", heads)
                          if body.get("group_query_attention") else heads}
    bias = body.get("add_qkv_bias", body.get("attention_bias", False))
    hf["attention_bias"] = bool(bias)
    qk_norm = bool(body.get("qk_layernorm"))
    if body.get("num_experts"):
        if not qk_norm:
            raise ConfigErrors([ConfigError(f"{name}.num_experts", "a MoE model without "
                                            "qk_layernorm (Qwen2-MoE style) is not built here "
                                            f"(in {where})", "supported MoE: Qwen3-MoE "
                                            "(qk_layernorm: true)")], where)
        hf["model_type"], hf["architectures"] = "qwen3_moe", ["Qwen3MoeForCausalLM"]
    elif qk_norm:
        hf["model_type"], hf["architectures"] = "qwen3", ["Qwen3ForCausalLM"]
    elif bias:
        hf["model_type"], hf["architectures"] = "qwen2", ["Qwen2ForCausalLM"]
    else:
        hf["model_type"], hf["architectures"] = "llama", ["LlamaForCausalLM"]
    return hf
