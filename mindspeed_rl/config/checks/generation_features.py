"""Checks of the generation side's features: vLLM's expert parallelism
(``enable_expert_parallel``, ``infer_expert_parallel_size``) and its expert map
(``expert_map_path``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_generation_features(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first of vLLM's expert-parallel keys set up wrong."""
    g, m = config.generate_config, config.model
    require(g.infer_expert_parallel_size >= 1, "generate_config.infer_expert_parallel_size",
            g.infer_expert_parallel_size, "must be at least 1", "use 1 (no expert parallelism)")
    require(g.infer_expert_parallel_size == 1 or g.enable_expert_parallel,
            "generate_config.infer_expert_parallel_size", g.infer_expert_parallel_size,
            "needs generate_config.enable_expert_parallel: true",
            "enable it, or set infer_expert_parallel_size: 1")
    require(not g.enable_expert_parallel or m.is_moe, "generate_config.enable_expert_parallel",
            True, f"the model ({m.model_type}) has no experts", "set it to false")
    require(g.expert_map_path is None or g.enable_expert_parallel,
            "generate_config.expert_map_path", g.expert_map_path, "places experts on vLLM's "
            "expert-parallel ranks, but generate_config.enable_expert_parallel is false",
            "set enable_expert_parallel: true (a MoE model), or remove expert_map_path")
