"""DeepSeek-V3 / R1: multi-latent attention (MLA) with YaRN RoPE and the DeepSeek mixture of experts.

Built from megatron-core's own modules: ``MLATransformerConfig`` and ``MLASelfAttention``
(low-rank query and key/value projections, RMSNorm on both latents, the decoupled RoPE head
with megatron's de-interleave, YaRN frequencies and softmax mscale), and the MoE layer with a
sigmoid ``TopKRouter`` carrying an expert bias (aux-loss-free balancing, updated by
megatron's ``finalize_model_grads``), group-limited top-k, a top-k scaling factor, shared
experts and the first ``first_k_dense_replace`` layers dense (``moe_layer_freq``).

Router: transformers' ``DeepseekV3TopkRouter`` picks experts by sigmoid score + bias (groups
by the sum of their top-2 scores), weighs them by the sigmoid scores, renormalises when
``norm_topk_prob`` and multiplies by ``routed_scaling_factor``. megatron's sigmoid routing
does the same when ``moe_router_topk // moe_router_group_topk == 2`` (it ranks groups by the
sum of their top ``topk // group_topk`` scores) and always renormalises for top-k > 1.
The multi-token-prediction layers a published checkpoint stores after the last decoder
layer (``num_nextn_predict_layers``) are not used by RL: the converters skip them.
"""

from __future__ import annotations

from mindspeed_rl.config.rank_parameters import padded_vocab_size
from mindspeed_rl.models import llama, qwen3_moe
from mindspeed_rl.models.architecture import (
    ModelArchitecture, UnsupportedConfigError, dense_decoder_config, require,
)
from mindspeed_rl.models.weight_map import GATE_UP, MOE, AttentionGeometry, Rule, WeightMap

NAME = "deepseek_v3"
MODEL_TYPES = ("deepseek_v3",)
HF_ARCHITECTURES = ("DeepseekV3ForCausalLM",)

ATTENTION_COMMON = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), tp_dim=0),
    Rule("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",)),
    Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), tp_dim=0),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), tp_dim=1),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
# With q_lora_rank: query down projection, its RMSNorm, up projection.
QUERY_LORA = (
    Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), tp_dim=0),
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",)),
    Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), tp_dim=0),
)
QUERY_FULL = (Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), tp_dim=0),)
ROUTER_BIAS = (
    # A buffer in megatron (float32, not trained by the optimizer): see builder.WEIGHT_BUFFERS.
    Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), scope=MOE),
)
SHARED_EXPERTS = (
    Rule("mlp.shared_experts.linear_fc1.weight",
         ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
         GATE_UP, tp_dim=0, scope=MOE),
    Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",),
         tp_dim=1, scope=MOE),
)


def rope_parameters(hf_config) -> dict:
    """RoPE settings from transformers 5 ``rope_parameters`` or the older ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**scaling, **params}
    if "rope_theta" not in merged and getattr(hf_config, "rope_theta", None) is not None:
        merged["rope_theta"] = hf_config.rope_theta
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    return merged


def rope_config(hf_config) -> dict:
    """MLATransformerConfig RoPE fields: plain RoPE or YaRN (factor, original positions,
    beta_fast/slow, mscale, mscale_all_dim)."""
    rope = rope_parameters(hf_config)
    require(rope.get("rope_theta") is not None, "config.json has no rope_theta")
    require(bool(getattr(hf_config, "rope_interleave", True)),
            "deepseek_v3 with rope_interleave=false is not supported (megatron's MLA "
            "de-interleaves the RoPE head as DeepSeek's checkpoints need)")
    fields = dict(rotary_base=float(rope["rope_theta"]), rotary_percent=1.0)
    if rope["rope_type"] == "default":
        return dict(fields, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope["rope_type"] != "yarn":
        raise UnsupportedConfigError(
            f"deepseek_v3 with rope type {rope['rope_type']!r} is not supported (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise UnsupportedConfigError("deepseek_v3 yarn with an explicit attention_factor is not "
                                     "supported (megatron derives it from mscale/mscale_all_dim)")
    factor = float(rope.get("factor") or hf_config.max_position_embeddings / rope["original_max_position_embeddings"])
    require(rope.get("truncate", True), "deepseek_v3 yarn with truncate=false is not supported "
            "(megatron rounds YaRN's correction range)")
    # transformers: cos/sin scaled by get_mscale(f, mscale) / get_mscale(f, mscale_all_dim) when
    # both are set, else by get_mscale(f); softmax by get_mscale(f, mscale_all_dim)^2.
    # megatron always uses the ratio; mscale 1 and mscale_all_dim 0 give the second case.
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        require(not mscale_all_dim, f"yarn mscale={mscale!r} with mscale_all_dim={mscale_all_dim!r} "
                "is not supported: set both, or mscale_all_dim 0")
        mscale, mscale_all_dim = 1.0, 0.0
    original = int(rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
    return dict(fields, rope_type="yarn", rotary_scaling_factor=factor,
                original_max_position_embeddings=original,
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))


def mla_config(hf_config) -> dict:
    """MLATransformerConfig attention fields."""
    q_lora = getattr(hf_config, "q_lora_rank", None)
    heads = int(hf_config.num_attention_heads)
    return dict(
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf_config.kv_lora_rank),
        qk_head_dim=int(hf_config.qk_nope_head_dim),
        qk_pos_emb_head_dim=int(hf_config.qk_rope_head_dim),
        v_head_dim=int(hf_config.v_head_dim),
        num_query_groups=heads,
        kv_channels=int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim),
        qk_layernorm=True,  # the RMSNorms of the query and key/value latents
        **rope_config(hf_config),
    )


def moe_layer_pattern(hf_config) -> tuple[bool, ...]:
    """Which decoder layers have experts (transformers' DeepseekV3DecoderLayer rule)."""
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
    return tuple(i >= first_dense and i % freq == 0 for i in range(int(hf_config.num_hidden_layers)))


def router_config(hf_config) -> dict:
    """TopKRouter fields: sigmoid scores plus expert bias, group-limited top-k, scaling."""
    topk = int(hf_config.num_experts_per_tok)
    scoring = getattr(hf_config, "scoring_func", None) or "sigmoid"
    method = getattr(hf_config, "topk_method", None) or "noaux_tc"
    require(scoring == "sigmoid", f"deepseek_v3 with scoring_func={scoring!r} is not supported (sigmoid)")
    require(method == "noaux_tc", f"deepseek_v3 with topk_method={method!r} is not supported "
            "(noaux_tc: sigmoid scores with e_score_correction_bias, as DeepSeek-V3 ships)")
    require(bool(hf_config.norm_topk_prob) == (topk > 1),
            f"norm_topk_prob={hf_config.norm_topk_prob} with num_experts_per_tok={topk}: megatron's "
            "sigmoid router renormalises the top-k weights exactly when top-k > 1")
    groups, group_topk = int(getattr(hf_config, "n_group", 1) or 1), int(getattr(hf_config, "topk_group", 1) or 1)
    fields = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_topk=topk, moe_router_dtype="fp32",
                  moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0))
    if groups > 1:
        require(group_topk <= groups, f"topk_group={group_topk} exceeds n_group={groups}")
        require(topk == 2 * group_topk,
                f"num_experts_per_tok={topk} with topk_group={group_topk}: transformers ranks groups by "
                "their top-2 scores, megatron by their top num_experts_per_tok/topk_group; they agree "
                "only when num_experts_per_tok = 2 x topk_group")
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return fields


def _weight_map(hf_config, pattern: tuple[bool, ...], tc: dict) -> WeightMap:
    vocab = int(hf_config.vocab_size)
    geometry = AttentionGeometry(num_attention_heads=tc["num_attention_heads"],
                                 num_query_groups=tc["num_query_groups"], head_dim=tc["kv_channels"],
                                 vocab_size=vocab, padded_vocab_size=padded_vocab_size(vocab))
    query = QUERY_LORA if tc["q_lora_rank"] is not None else QUERY_FULL
    rules = (llama.EMBEDDING_AND_HEAD + ATTENTION_COMMON + query + llama.DENSE_MLP
             + qwen3_moe.MOE_MLP + ROUTER_BIAS + (SHARED_EXPERTS if tc.get("moe_shared_expert_intermediate_size") else ()))
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    n = tc["num_layers"]
    mtp = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    skipped = {rf"model\.layers\.({'|'.join(str(n + i) for i in range(mtp))})\..*":
               f"the {mtp} multi-token-prediction layer(s) (num_nextn_predict_layers), not used by RL"} if mtp else {}
    return WeightMap(rules, geometry, num_layers=n, moe_layers=pattern,
                     num_experts=tc["num_moe_experts"], tie_embeddings=tied,
                     ignored_hf=llama.ignored_hf(tied), skipped_hf=skipped)


def describe(hf_config) -> ModelArchitecture:
    require(not getattr(hf_config, "attention_bias", False),
            "deepseek_v3 with attention_bias=true is not supported")
    tc = dense_decoder_config(hf_config, add_qkv_bias=False, qk_layernorm=True)
    tc.update(mla_config(hf_config))
    pattern = moe_layer_pattern(hf_config)
    num_experts = int(hf_config.n_routed_experts)
    require(any(pattern) and num_experts > 0, "deepseek_v3 config has no expert layers")
    shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    tc.update(
        num_moe_experts=num_experts,
        moe_layer_freq=[int(m) for m in pattern],
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_shared_expert_intermediate_size=shared * int(hf_config.moe_intermediate_size) or None,
        # The sequence aux loss changes gradients only; a trainer sets its coefficient.
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        **router_config(hf_config),
    )
    wm = _weight_map(hf_config, pattern, tc)
    g = wm.geometry
    return ModelArchitecture(
        name=NAME, hf_config=hf_config, transformer_config_kwargs=tc, weight_map=wm,
        vocab_size=g.vocab_size, padded_vocab_size=g.padded_vocab_size,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rotary_base=tc["rotary_base"],
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_experts=num_experts,
    )
