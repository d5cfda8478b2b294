"""DeepSeek-V3's shape rules: group-limited routing and multi-latent attention under TP.

`routing_problems` checks the router's numbers on their own (a model yaml's names or
config.json's, as the caller names them): ``topk_group`` groups of ``n_group`` equal
groups of experts, then top-k experts inside them. megatron-core scores a group by the
sum of its top ``moe_router_topk / moe_router_group_topk`` experts, transformers' and
vLLM's DeepseekV3 by its top 2: the two agree (and the trained policy is the one vLLM
samples from) only when top-k is twice the chosen groups (DeepSeek-V3: 8 = 2 x 4), the
build's rule (`mindspeed_rl.models.deepseek_v3`). Its sigmoid router renormalises the top-k
weights exactly when top-k > 1, so ``norm_topk_prob`` must say the same.

`mla_tensor_parallel_problem` checks what megatron-core's local multi-latent attention
splits over TP besides the heads: its column-parallel query down projection
(``q_lora_rank`` rows) and KV down projection (``kv_lora_rank + qk_rope_head_dim`` rows).
"""

from __future__ import annotations

from typing import Callable

from mindspeed_rl.config.config_error import ConfigError

# HF name -> the Megatron name a MindSpeed model yaml uses for it
MEGATRON_NAMES = {"n_group": "moe_router_num_groups", "topk_group": "moe_router_group_topk",
                  "norm_topk_prob": "norm_topk_prob",
                  "num_experts_per_tok": "moe_router_topk", "num_experts": "num_experts",
                  "n_routed_experts": "num_experts",
                  "first_k_dense_replace": "first_k_dense_replace",
                  "moe_layer_freq": "moe_layer_freq", "num_hidden_layers": "num_layers"}


def routing_problems(fields: dict, key: Callable[[str], str]) -> list[ConfigError]:
    """Problems of DeepSeek-V3's routing numbers in ``fields`` (HF names); ``key(hf_name)``
    is the dotted key to name for each."""
    experts = fields.get("n_routed_experts") or fields.get("num_experts")
    groups, top_groups = fields.get("n_group") or 1, fields.get("topk_group") or 1
    topk = fields.get("num_experts_per_tok") or 1
    layers, dense = fields.get("num_hidden_layers"), fields.get("first_k_dense_replace") or 0
    problems = []

    def refuse(name: str, problem: str, fix: str) -> None:
        problems.append(ConfigError(key(name), problem, fix, value=fields.get(name)))

    if top_groups > groups:
        refuse("topk_group", f"a token routes to more groups than there are: {key('n_group')}"
               f"={groups}", f"use at most {groups}")
    if experts and experts % groups:
        refuse("n_group", f"does not divide the {experts} routed experts into equal groups "
               f"({key('num_experts')}={experts})", "use a divisor of the expert count")
    elif experts and top_groups <= groups and topk > top_groups * (experts // groups):
        refuse("num_experts_per_tok", f"more experts than the {top_groups} chosen groups hold "
               f"({experts // groups} each)", "lower the top-k or choose more groups")
    if groups > 1 and topk != 2 * top_groups:
        refuse("num_experts_per_tok", f"megatron-core scores a group by its top "
               f"{key('num_experts_per_tok')} / {key('topk_group')} = {topk} / {top_groups} "
               "experts, transformers' and vLLM's DeepseekV3 by its top 2: training and "
               "rollout would route differently", f"use top-k = 2 x {key('topk_group')} = "
               f"{2 * top_groups}")
    norm = fields.get("norm_topk_prob")
    if norm is not None and bool(norm) != (topk > 1):
        refuse("norm_topk_prob", f"megatron-core's sigmoid router renormalises the top-k "
               f"weights exactly when top-k > 1 ({key('num_experts_per_tok')}={topk}); "
               "transformers and vLLM follow norm_topk_prob", f"set it to "
               f"{'true' if topk > 1 else 'false'}")
    if layers is not None and dense >= layers:
        refuse("first_k_dense_replace", f"leaves no MoE layer in the model's {layers} layers",
               f"use fewer than {layers} dense layers")
    if fields.get("moe_layer_freq") not in (None, 1):
        refuse("moe_layer_freq", "transformers' and vLLM's DeepseekV3 put experts in every "
               "layer after the dense ones", "use 1")
    return problems


def mla_tensor_parallel_problem(model, tp: int, tp_key: str) -> ConfigError | None:
    """The first MLA dimension (besides the heads) that ``tp`` does not divide."""
    for name, size in (("q_lora_rank", model.q_lora_rank or 0),
                       ("kv_lora_rank + qk_rope_head_dim", model.kv_latent_dim)):
        if size % tp:
            return ConfigError(tp_key, f"does not divide the model's {name}={size}: megatron-"
                               "core's multi-latent attention splits that down projection "
                               "over TP (column-parallel)", f"use a TP that divides {size} and "
                               f"num_attention_heads={model.num_attention_heads}", value=tp)
    return None
