"""DeepSeek-V3's keys in a MindSpeed-RL model yaml -> transformers' DeepseekV3Config fields.

MindSpeed-LLM describes DeepSeek-V3 with Megatron's names (``multi_latent_attention``,
``qk_head_dim``, ``moe_router_num_groups``, ``rope_scaling_factor``...), and MindSpeed-RL
2.0.0 to 2.2.0 with older ones (``multi_head_latent_attention``, ``qk_nope_head_dim``,
``n_group``, ``rope_scaling_beta_fast``...). Both become the ``config.json`` fields of
``DeepseekV3ForCausalLM`` (model_type ``deepseek_v3``), the names vLLM and transformers
read. A key that only DeepSeek-V3 has, in a yaml without multi-latent attention, is an
architecture not built here; so is a DeepSeek-V3 that this family does not build (no
expert bias, a softmax router, no LoRA norms), each named by its key.
"""

from __future__ import annotations

from typing import Any

from mindspeed_rl.config.deepseek_checks import MEGATRON_NAMES, routing_problems
from mindspeed_rl.config.config_error import ConfigError, show_value

MLA_SWITCHES = ("multi_latent_attention", "multi_head_latent_attention")

# Megatron / MindSpeed name -> DeepseekV3Config name (same value).
RENAMED = {
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "v_head_dim": "v_head_dim",
    "qk_head_dim": "qk_nope_head_dim", "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "first_k_dense_replace": "first_k_dense_replace", "n_shared_experts": "n_shared_experts",
    "moe_layer_freq": "moe_layer_freq", "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    # MindSpeed-RL 2.0.0 to 2.2.0
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "n_group": "n_group", "topk_group": "topk_group",
    "routed_scaling_factor": "routed_scaling_factor",
}
# Megatron name -> key of config.json's rope_scaling.
ROPE_SCALING = {
    "rope_scaling_type": "type", "rope_scaling_factor": "factor", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "rope_scaling_beta_fast": "beta_fast",
    "rope_scaling_beta_slow": "beta_slow", "rope_scaling_mscale": "mscale",
    "rope_scaling_mscale_all_dim": "mscale_all_dim",
    "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings",
}
# Router and balancing keys, read by `_router_fields`.
ROUTER = ("moe_router_score_function", "moe_router_enable_expert_bias",
          "moe_router_load_balancing_type", "seq_aux", "norm_topk_prob")
DEEPSEEK_KEYS = frozenset(MLA_SWITCHES) | frozenset(RENAMED) | frozenset(ROPE_SCALING) | (
    frozenset(ROUTER))
# The value of each key that means "not DeepSeek-V3" (allowed in any model yaml).
_PLAIN = {"first_k_dense_replace": (None, 0), "n_shared_experts": (None, 0),
          "moe_layer_freq": (None, 1), "moe_router_score_function": ("softmax", None),
          "moe_router_enable_expert_bias": (False, None), "seq_aux": (True, False, None),
          **{k: (None, 1) for k in ("moe_router_num_groups", "moe_router_group_topk",
                                    "n_group", "topk_group")},
          **{k: (None, 1, 1.0) for k in ("moe_router_topk_scaling_factor",
                                         "routed_scaling_factor")},
          "norm_topk_prob": (True, False, None), "rope_scaling_type": (None,),
          "moe_router_load_balancing_type": ("aux_loss", "none", None),
          **{k: (False, None) for k in MLA_SWITCHES}}
# Balancing types: MindSpeed's names -> (sequence-wise aux loss, the expert bias in routing)
_BALANCING = {"aux_loss": False, "none": False, "seq_aux_loss": True, "noaux_tc": False}


def is_mla(body: dict) -> bool:
    return any(body.get(k) is True for k in MLA_SWITCHES)


def plain_model_problems(body: dict, name: str, where: str) -> list[ConfigError]:
    """DeepSeek-V3 keys in a yaml without multi-latent attention: each one that is set."""
    problems = []
    for key in DEEPSEEK_KEYS:
        if key not in body:
            continue
        value, plain = body[key], _PLAIN.get(key, (None,))
        if not any(value == ok and type(value) is type(ok) or value is ok for ok in plain):
            problems.append(ConfigError(
                f"{name}.{key}", f"is an architecture not built here (in {where})",
                "supported: " + " or ".join(map(show_value, plain)) + "; DeepSeek-V3's keys "
                "need multi_latent_attention: true", value=value))
    return problems


def deepseek_fields(body: dict, name: str, where: str) -> tuple[dict[str, Any], list[ConfigError]]:
    """``(DeepseekV3Config fields, problems)`` of a model yaml with multi-latent attention.
    Fields are written out where DeepseekV3Config's default differs from Megatron's."""
    problems: list[ConfigError] = []

    def refuse(key: str, problem: str, fix: str) -> None:
        problems.append(ConfigError(f"{name}.{key}", f"{problem} (in {where})", fix,
                                    value=body.get(key)))

    hf: dict[str, Any] = {"model_type": "deepseek_v3",
                          "architectures": ["DeepseekV3ForCausalLM"],
                          # Megatron's defaults where DeepseekV3Config's differ
                          "q_lora_rank": None, "first_k_dense_replace": 0, "n_shared_experts": 0,
                          "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}
    hf.update({RENAMED[k]: v for k, v in body.items() if k in RENAMED})
    for keys, hf_name in ((("kv_lora_rank",), "kv_lora_rank"),
                          (("qk_head_dim", "qk_nope_head_dim"), "qk_nope_head_dim"),
                          (("qk_pos_emb_head_dim", "qk_rope_head_dim"), "qk_rope_head_dim"),
                          (("v_head_dim",), "v_head_dim"), (("num_experts",), "num_experts")):
        if not any(k in body for k in keys):
            refuse(keys[0], "required key is missing: multi-latent attention here is "
                   "DeepSeek-V3's (MLA with routed experts)", "copy it from the model's "
                   "MindSpeed-LLM yaml")
    if body.get("qk_layernorm") is not True:
        refuse("qk_layernorm", "multi-latent attention without its LoRA RMSNorms is not built "
               "here (DeepSeek-V3 has q_a_layernorm and kv_a_layernorm)", "set it to true")
    for key in ("add_qkv_bias", "attention_bias"):
        if body.get(key):
            refuse(key, "multi-latent attention with biases is not built here (megatron-core's "
                   "MLA projections have none)", "remove the key")
    if "num_experts" in body:
        hf["n_routed_experts"] = body["num_experts"]
    hf["head_dim"] = hf.get("qk_rope_head_dim")   # as DeepseekV3Config sets it
    hf["num_key_value_heads"] = body.get("num_attention_heads")
    hf.update(_router_fields(body, refuse))
    scaling = {ROPE_SCALING[k]: v for k, v in body.items() if k in ROPE_SCALING}
    if scaling:
        if scaling.get("type") != "yarn":
            refuse("rope_scaling_type", "RoPE scaling other than YaRN is not built here for "
                   "multi-latent attention", "use rope_scaling_type: yarn, or remove the "
                   "rope_scaling_* keys")
        if scaling.get("mscale_all_dim") and not scaling.get("mscale"):
            refuse("rope_scaling_mscale_all_dim", "YaRN's mscale_all_dim without mscale is "
                   "not built here (megatron-core scales by their ratio)", "set "
                   "rope_scaling_mscale too (DeepSeek-V3: both 1.0), or remove the key")
        hf["rope_scaling"] = scaling
    shape = {"num_hidden_layers": body.get("num_layers"),
             "num_experts_per_tok": body.get("moe_router_topk"), **hf}
    problems += routing_problems(shape, lambda hf_name: f"{name}.{_written(body, hf_name)}")
    return hf, problems


def _written(body: dict, hf_name: str) -> str:
    """The model yaml's key for DeepseekV3Config's ``hf_name`` (as the file spells it)."""
    for key, target in RENAMED.items():
        if target == hf_name and key in body:
            return key
    return MEGATRON_NAMES.get(hf_name, hf_name)


def _router_fields(body: dict, refuse) -> dict[str, Any]:
    """DeepSeek-V3's router: sigmoid scores, the expert bias (``topk_method: noaux_tc``, which
    vLLM needs to create ``e_score_correction_bias``), the sequence-wise balancing loss."""
    if body.get("moe_router_score_function") != "sigmoid":
        refuse("moe_router_score_function", "DeepSeek-V3's router is built here with sigmoid "
               "scores only (transformers' and vLLM's DeepseekV3)", "set it to sigmoid")
    if body.get("moe_router_enable_expert_bias") is not True:
        refuse("moe_router_enable_expert_bias", "DeepSeek-V3's router is built here with its "
               "expert bias (aux-loss-free balancing, noaux_tc) only", "set it to true")
    balancing = body.get("moe_router_load_balancing_type", "aux_loss")
    if balancing not in _BALANCING:
        refuse("moe_router_load_balancing_type", "not a balancing type of DeepSeek-V3 here",
               "use one of: " + ", ".join(_BALANCING))
    return {"scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "norm_topk_prob": bool(body.get("norm_topk_prob", False)),
            "seq_aux": bool(_BALANCING.get(balancing) or body.get("seq_aux"))}
