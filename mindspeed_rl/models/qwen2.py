"""Qwen2 / Qwen2.5: the Llama decoder plus a bias on the q, k and v projections (not on o_proj)."""

from __future__ import annotations

from mindspeed_rl.models import llama
from mindspeed_rl.models.architecture import ModelArchitecture, dense_decoder_config, geometry, make_architecture
from mindspeed_rl.models.weight_map import WeightMap

NAME = "qwen2"
MODEL_TYPES = ("qwen2",)
HF_ARCHITECTURES = ("Qwen2ForCausalLM",)

RULES = llama.EMBEDDING_AND_HEAD + llama.ATTENTION + llama.QKV_BIAS + llama.DENSE_MLP


def describe(hf_config) -> ModelArchitecture:
    tc = dense_decoder_config(hf_config, add_qkv_bias=True, qk_layernorm=False)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    wm = WeightMap(RULES, geometry(hf_config), num_layers=tc["num_layers"], tie_embeddings=tied,
                   ignored_hf=llama.ignored_hf(tied))
    return make_architecture(NAME, hf_config, tc, wm)
