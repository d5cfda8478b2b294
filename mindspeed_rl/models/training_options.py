"""Job settings that shape the megatron model and the vLLM engine beyond the architecture.

`training_model_options` maps ``actor_config`` keys onto megatron-core's own
TransformerConfig fields: activation recompute (``recompute_granularity``,
``recompute_method``, ``recompute_num_layers``), uneven pipeline stages
(``num_layer_list`` -> ``num_layers_in_first/last_pipeline_stage`` when only the first and
last stages differ, else ``pipeline_model_parallel_layout``), the MoE aux loss and the
context-parallel algorithm (``context_parallel_algo`` -> megatron's ``cp_comm_type``).
"""

from __future__ import annotations

from typing import Any

from mindspeed_rl.parallel.layout import pipeline_stage_layers


def stage_layer_options(num_layers: int, pipeline_model_parallel_size: int,
                        num_layer_list: str | None) -> dict[str, Any]:
    """megatron-core TransformerConfig fields placing ``num_layer_list``'s layers per stage."""
    pp = pipeline_model_parallel_size
    if num_layer_list is None or pp == 1:
        return {}
    counts = pipeline_stage_layers(num_layers, pp, num_layer_list)
    if len(set(counts)) == 1:
        return {}
    middle = counts[1:-1]
    if len(set(middle)) <= 1:
        return {"num_layers_in_first_pipeline_stage": counts[0],
                "num_layers_in_last_pipeline_stage": counts[-1]}
    # Any other split: megatron-core's layout string, E = embedding, t = layer, L = loss.
    stages = ["t*" + str(c) for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return {"pipeline_model_parallel_layout": "|".join(stages)}


def training_model_options(config) -> dict[str, Any]:
    """Extra TransformerConfig fields of every training-layout model of ``config`` (actor,
    reference, critic, reward model)."""
    a = config.actor_config
    options: dict[str, Any] = stage_layer_options(
        config.model.num_hidden_layers, a.pipeline_model_parallel_size, a.num_layer_list)
    if a.recompute_granularity is not None:
        options.update(recompute_granularity=a.recompute_granularity,
                       recompute_method=a.recompute_method,
                       recompute_num_layers=a.recompute_num_layers)
    if a.context_parallel_size > 1:  # ring or Ulysses: megatron's cp_comm_type
        options["context_parallel_algo"] = a.context_parallel_algo
    if config.model.is_moe:
        # The family's balancing loss (per sequence for DeepSeek-V3), on when it has a weight.
        balancing = "seq_aux_loss" if config.model.seq_aux else "aux_loss"
        options.update(moe_aux_loss_coeff=a.moe_aux_loss_coeff,
                       moe_router_load_balancing_type=balancing if a.moe_aux_loss_coeff
                       else "none")
        if config.features.router_replay:  # every router gets a RouterReplay
            options["moe_enable_routing_replay"] = True
    return options
