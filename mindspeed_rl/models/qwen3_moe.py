"""Qwen3-MoE: Qwen3 attention (qk-layernorm) with a top-k softmax-routed mixture of experts.

Router: HF takes softmax over all experts, keeps the top k and, if norm_topk_prob,
renormalises them. Megatron's softmax router with ``moe_router_pre_softmax=False`` takes
the top k logits then softmaxes them, which equals the renormalised probabilities; with
``pre_softmax=True`` it keeps the un-renormalised top-k probabilities. Layers listed in
mlp_only_layers, or off the decoder_sparse_step grid, keep a dense MLP
(megatron's ``moe_layer_freq`` pattern). Qwen3-MoE has no shared experts.
"""

from __future__ import annotations

from mindspeed_rl.models import llama, qwen3
from mindspeed_rl.models.architecture import (
    ModelArchitecture, dense_decoder_config, geometry, make_architecture, require,
)
from mindspeed_rl.models.weight_map import EXPERT, GATE_UP, MOE, Rule, WeightMap

NAME = "qwen3_moe"
MODEL_TYPES = ("qwen3_moe",)
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)

MOE_MLP = (
    Rule("mlp.router.weight", ("mlp.gate.weight",), scope=MOE),
    Rule("mlp.experts.local_experts.{expert}.linear_fc1.weight",
         ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
         GATE_UP, tp_dim=0, scope=EXPERT),
    Rule("mlp.experts.local_experts.{expert}.linear_fc2.weight",
         ("mlp.experts.{expert}.down_proj.weight",), tp_dim=1, scope=EXPERT),
)
RULES = llama.EMBEDDING_AND_HEAD + llama.ATTENTION + qwen3.QK_NORM + llama.DENSE_MLP + MOE_MLP


def moe_layer_pattern(hf_config) -> tuple[bool, ...]:
    """Which decoder layers have experts (transformers' Qwen3MoeDecoderLayer rule)."""
    n = int(hf_config.num_hidden_layers)
    num_experts = int(hf_config.num_experts)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))


def describe(hf_config) -> ModelArchitecture:
    require(not getattr(hf_config, "attention_bias", False),
            "qwen3_moe with attention_bias=true (bias on q/k/v/o) is not supported")
    tc = dense_decoder_config(hf_config, add_qkv_bias=False, qk_layernorm=True)
    pattern = moe_layer_pattern(hf_config)
    require(any(pattern), "qwen3_moe config has no expert layers (num_experts=0 or all mlp_only_layers)")
    num_experts = int(hf_config.num_experts)
    tc.update(
        num_moe_experts=num_experts,
        moe_layer_freq=[int(m) for m in pattern],
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(hf_config.norm_topk_prob),
        # The aux loss changes gradients only; a trainer may switch it on with its coefficient.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    wm = WeightMap(RULES, geometry(hf_config), num_layers=tc["num_layers"], moe_layers=pattern,
                   num_experts=num_experts, tie_embeddings=tied, ignored_hf=llama.ignored_hf(tied))
    return make_architecture(NAME, hf_config, tc, wm, num_experts=num_experts)
