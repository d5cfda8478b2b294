"""Architecture name -> module. Unknown architectures fail with the supported list."""

from __future__ import annotations

from types import ModuleType

from mindspeed_rl.models import deepseek_v3, llama, qwen2, qwen3, qwen3_moe
from mindspeed_rl.models.architecture import ModelArchitecture

ARCHITECTURES: dict[str, ModuleType] = {m.NAME: m for m in (llama, qwen2, qwen3, qwen3_moe, deepseek_v3)}


class UnsupportedArchitectureError(ValueError):
    """The HF config names an architecture with no megatron mapping."""


def supported_architectures() -> list[str]:
    """Registry names with the HF class names they accept."""
    return [f"{name} ({', '.join(m.HF_ARCHITECTURES)})" for name, m in ARCHITECTURES.items()]


def architecture_module(hf_config) -> ModuleType:
    """The module for an HF config, chosen by ``model_type`` then by ``architectures``."""
    model_type = getattr(hf_config, "model_type", None)
    for module in ARCHITECTURES.values():
        if model_type in module.MODEL_TYPES:
            return module
    for arch in getattr(hf_config, "architectures", None) or ():
        for module in ARCHITECTURES.values():
            if arch in module.HF_ARCHITECTURES:
                return module
    raise UnsupportedArchitectureError(
        f"unsupported architecture: model_type={model_type!r}, "
        f"architectures={getattr(hf_config, 'architectures', None)!r}; supported: "
        + "; ".join(supported_architectures())
    )


def describe_model(hf_config) -> ModelArchitecture:
    """HF config -> `ModelArchitecture` (TransformerConfig fields + weight map)."""
    return architecture_module(hf_config).describe(hf_config)
