"""Checks of MoE routing replay (``rl_config.router_replay``: R2, R3).

R2 replays in the update the routes the old-log-prob pass recorded; R3 the routes vLLM chose
during the rollout. Both need a MoE model and one pipeline stage and context-parallel rank;
R3 also vLLM's in-process routers (and no prefix caching: the loader turns it off for R3,
``loader._prefix_caching_for_r3``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_router_replay(config: RLJobConfig) -> None:
    """MoE routing replay: a MoE model, and a layout and platform where the routes can be
    recorded and replayed (megatron-core's RouterReplay; R3 also vLLM's routers, in process)."""
    m, actor = config.model, config.actor_config
    mode = config.features.router_replay
    if mode is None:
        return
    require(m.is_moe, "rl_config.router_replay", mode,
            f"replays the experts of a MoE model, and {m.model_type} has none",
            "set router_replay: none for a dense model")
    for key, value in (("pipeline_model_parallel_size", actor.pipeline_model_parallel_size),
                       ("context_parallel_size", actor.context_parallel_size)):
        require(value == 1, "rl_config.router_replay", mode,
                f"routes are laid out per micro-batch on one stage and one context-parallel "
                f"rank here, and actor_config.{key}={value}",
                f"set router_replay: none, or actor_config.{key}: 1")
    if config.features.replays_rollout_routing:
        from mindspeed_rl.platform.platform import detected_device_type

        device = detected_device_type()
        require(device in ("cpu", "cuda"), "rl_config.router_replay", mode,
                f"records vLLM's routed experts through vLLM's in-process routers "
                f"(BaseRouter.set_capture_fn), which the {device} engine (vllm-ascend) does "
                "not provide", "use router_replay: R2 (training-side replay) on this platform")
