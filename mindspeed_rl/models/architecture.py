"""What an architecture module produces from an HF config: `ModelArchitecture`.

The architecture modules (`llama`, `qwen2`, `qwen3`, `qwen3_moe`) each turn an HF
config into one of these; the builder turns it into a megatron GPTModel and the
converters use its `weight_map`. Shared config reading (RoPE, activation, the
dense-decoder TransformerConfig fields) lives here so each module states only
how its architecture differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mindspeed_rl.config.rank_parameters import padded_vocab_size
from mindspeed_rl.models.weight_map import AttentionGeometry, WeightMap


class UnsupportedConfigError(ValueError):
    """An HF config uses a feature the megatron mapping cannot reproduce exactly."""


@dataclass(frozen=True, eq=False)
class ModelArchitecture:
    """An HF model described in megatron terms (no parallel layout yet)."""

    name: str                                   # registry name, e.g. "qwen3_moe"
    hf_config: Any                              # transformers.PretrainedConfig
    transformer_config_kwargs: dict[str, Any]   # TransformerConfig fields that define the model
    weight_map: WeightMap
    vocab_size: int
    padded_vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    share_embeddings_and_output_weights: bool
    num_experts: int | None = None
    gpt_model_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.transformer_config_kwargs["num_layers"]


def rope_theta(hf_config) -> float:
    """RoPE base, from transformers 5 ``rope_parameters`` or the older ``rope_theta``.

    Scaled RoPE variants (yarn, llama3, linear, dynamic) change the frequencies in ways the
    plain megatron rotary embedding does not reproduce, so they are refused rather than
    silently diverging from transformers.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise UnsupportedConfigError(
            f"rope type {rope_type!r} (rope_parameters/rope_scaling in config.json) is not supported; "
            "only the default RoPE maps exactly onto megatron's rotary embedding"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedConfigError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def head_dim(hf_config) -> int:
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def num_kv_heads(hf_config) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UnsupportedConfigError(message)


def dense_decoder_config(hf_config, *, add_qkv_bias: bool, qk_layernorm: bool) -> dict[str, Any]:
    """TransformerConfig fields of a pre-norm RMSNorm + RoPE + SwiGLU decoder (Llama family).

    The fusion flags are off because the fused kernels need CUDA/Apex/TE; off, the
    math is identical and the model runs eagerly on every device.
    """
    require(getattr(hf_config, "hidden_act", "silu") == "silu",
            f"hidden_act={hf_config.hidden_act!r} is not supported (SwiGLU needs 'silu')")
    require(not getattr(hf_config, "mlp_bias", False), "mlp_bias=true is not supported")
    require(not getattr(hf_config, "use_sliding_window", False),
            "use_sliding_window=true is not supported (megatron attention here is full causal)")
    return dict(
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        ffn_hidden_size=int(hf_config.intermediate_size),
        num_attention_heads=int(hf_config.num_attention_heads),
        num_query_groups=num_kv_heads(hf_config),
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=add_qkv_bias,
        qk_layernorm=qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def geometry(hf_config) -> AttentionGeometry:
    vocab = int(hf_config.vocab_size)
    return AttentionGeometry(
        num_attention_heads=int(hf_config.num_attention_heads),
        num_query_groups=num_kv_heads(hf_config),
        head_dim=head_dim(hf_config),
        vocab_size=vocab,
        padded_vocab_size=padded_vocab_size(vocab),
    )


def make_architecture(name: str, hf_config, tc_kwargs: dict[str, Any], weight_map: WeightMap,
                      *, num_experts: int | None = None) -> ModelArchitecture:
    g = weight_map.geometry
    return ModelArchitecture(
        name=name,
        hf_config=hf_config,
        transformer_config_kwargs=tc_kwargs,
        weight_map=weight_map,
        vocab_size=g.vocab_size,
        padded_vocab_size=g.padded_vocab_size,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        num_experts=num_experts,
    )
