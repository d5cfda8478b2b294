"""Llama (e.g. SmolLM2): RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings.

Its weight tables are the base of the Qwen modules, which add to them.
"""

from __future__ import annotations

from mindspeed_rl.models.architecture import (
    ModelArchitecture, dense_decoder_config, geometry, make_architecture, require,
)
from mindspeed_rl.models.weight_map import DENSE, GATE_UP, GLOBAL, QKV, VOCAB, Rule, WeightMap

NAME = "llama"
MODEL_TYPES = ("llama",)
HF_ARCHITECTURES = ("LlamaForCausalLM",)

EMBEDDING_AND_HEAD = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, tp_dim=0, scope=GLOBAL),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), scope=GLOBAL),
    # Absent from the map when the embeddings are tied (megatron then shares the embedding).
    Rule("output_layer.weight", ("lm_head.weight",), VOCAB, tp_dim=0, scope=GLOBAL),
)
ATTENTION = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_qkv.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), QKV, tp_dim=0),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), tp_dim=1),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
)
QKV_BIAS = (
    Rule("self_attention.linear_qkv.bias",
         ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), QKV, tp_dim=0),
)
DENSE_MLP = (
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP, tp_dim=0, scope=DENSE),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), tp_dim=1, scope=DENSE),
)
# Old checkpoints store the rotary cache; it is recomputed from rope_theta.
IGNORED_HF = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
TIED_HEAD = (r"lm_head\.weight",)  # some tied checkpoints still store a copy of the embedding


def ignored_hf(tied: bool) -> tuple[str, ...]:
    return IGNORED_HF + (TIED_HEAD if tied else ())


def describe(hf_config) -> ModelArchitecture:
    # Llama's attention_bias also puts a bias on o_proj, which megatron's add_qkv_bias lacks.
    require(not getattr(hf_config, "attention_bias", False),
            "llama with attention_bias=true (bias on q/k/v/o) is not supported")
    tc = dense_decoder_config(hf_config, add_qkv_bias=False, qk_layernorm=False)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    wm = WeightMap(EMBEDDING_AND_HEAD + ATTENTION + DENSE_MLP, geometry(hf_config),
                   num_layers=tc["num_layers"], tie_embeddings=tied, ignored_hf=ignored_hf(tied))
    return make_architecture(NAME, hf_config, tc, wm)
