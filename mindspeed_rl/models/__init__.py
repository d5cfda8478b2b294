"""Model architectures in megatron-core with their HF <-> megatron weight maps.

Supported: llama (SmolLM2, tied embeddings), qwen2 (Qwen2.5, qkv bias), qwen3 (qk-layernorm),
qwen3_moe (experts, router; expert parallelism). See `registry.ARCHITECTURES`.
Each also builds as a scalar-head model (critic, reward model; HF *ForSequenceClassification):
see `value_head`.
"""

from mindspeed_rl.models.architecture import ModelArchitecture, UnsupportedConfigError
from mindspeed_rl.models.registry import (
    ARCHITECTURES, UnsupportedArchitectureError, architecture_module, describe_model,
    supported_architectures,
)
from mindspeed_rl.models.weight_map import WeightMap

__all__ = [
    "ARCHITECTURES", "ModelArchitecture", "UnsupportedArchitectureError", "UnsupportedConfigError",
    "WeightMap", "architecture_module", "describe_model", "supported_architectures",
]
