"""Qwen3 (dense): the Llama decoder plus RMSNorm on each query and key head (qk-layernorm).

head_dim is explicit in Qwen3 configs and may differ from hidden_size / num_heads; it maps
to megatron's kv_channels.
"""

from __future__ import annotations

from mindspeed_rl.models import llama
from mindspeed_rl.models.architecture import (
    ModelArchitecture, dense_decoder_config, geometry, make_architecture, require,
)
from mindspeed_rl.models.weight_map import Rule, WeightMap

NAME = "qwen3"
MODEL_TYPES = ("qwen3",)
HF_ARCHITECTURES = ("Qwen3ForCausalLM",)

QK_NORM = (
    Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)
RULES = llama.EMBEDDING_AND_HEAD + llama.ATTENTION + QK_NORM + llama.DENSE_MLP


def describe(hf_config) -> ModelArchitecture:
    require(not getattr(hf_config, "attention_bias", False),
            "qwen3 with attention_bias=true (bias on q/k/v/o) is not supported")
    tc = dense_decoder_config(hf_config, add_qkv_bias=False, qk_layernorm=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    wm = WeightMap(RULES, geometry(hf_config), num_layers=tc["num_layers"], tie_embeddings=tied,
                   ignored_hf=llama.ignored_hf(tied))
    return make_architecture(NAME, hf_config, tc, wm)
