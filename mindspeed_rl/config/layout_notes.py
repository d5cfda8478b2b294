"""The plan's layout in words: uneven pipeline stages and where the experts live.

Lines printed under the plan's layout table: the layers of each pipeline stage when
``actor_config.num_layer_list`` sets them (and how many of them are MoE layers when the
model has dense first layers), the routed experts of one MoE layer per training rank
(EP, with MindSpeed's ``moe_tp_extend_ep`` spelled out as expert_model_parallel_size x TP),
and per vLLM rank with ``generate_config.enable_expert_parallel`` (vLLM's EP size is
infer_tensor_parallel_size x infer_expert_parallel_size, as in MindSpeed-RL), with which
training ranks hold a vLLM rank's experts: the allgather-swap gathers them from there.
"""

from __future__ import annotations

from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.parallel.layout import ParallelLayout, pipeline_stage_layers


def layout_notes(config: RLJobConfig, layout: ParallelLayout) -> list[str]:
    m, a, g = config.model, config.actor_config, config.generate_config
    lines = []
    pp = layout.pipeline_model_parallel_size
    if a.num_layer_list is not None and pp > 1:
        stages = pipeline_stage_layers(m.num_hidden_layers, pp, a.num_layer_list)
        line = (f"pipeline stages: {','.join(map(str, stages))} layers "
                "(actor_config.num_layer_list)")
        if m.is_moe and m.num_moe_layers != m.num_hidden_layers:
            first, moe = 0, []
            for count in stages:
                moe.append(sum(m.is_moe_layer(i) for i in range(first, first + count)))
                first += count
            line += f", of them MoE layers: {','.join(map(str, moe))}"
        lines.append(line)
    if not m.is_moe:
        return lines
    tp, ep, etp = layout.tensor_model_parallel_size, layout.expert_model_parallel_size, (
        layout.expert_tp)
    per_rank = m.num_experts // ep
    extended = any(".moe_tp_extend_ep=true" in n for n in config.notices)
    spread = (f"EP {ep} = expert_model_parallel_size {ep // tp} x TP {tp} (moe_tp_extend_ep: "
              "experts whole, not split by TP)" if extended else f"EP {ep} x expert TP {etp}")
    lines.append(f"experts (training): {m.num_experts} routed per MoE layer over {spread}: "
                 f"{per_rank} per rank, expert-DP {layout.expert_data_parallel_size}")
    if g.enable_expert_parallel:
        epg = layout.infer_tensor_parallel_size * g.infer_expert_parallel_size
        per_g = m.num_experts // epg
        if per_rank % per_g == 0:
            source = (f"each vLLM EP rank's experts lie on one training EP rank (vLLM EP rank r "
                      f"<- training EP rank r // {per_rank // per_g})")
        elif per_g % per_rank == 0:
            source = f"each vLLM EP rank gathers its experts from {per_g // per_rank} training EP ranks"
        else:
            source = "vLLM EP ranks' experts straddle training EP ranks"
        lines.append(f"experts (vLLM): EP {epg} = generate_config.infer_tensor_parallel_size "
                     f"{layout.infer_tensor_parallel_size} x infer_expert_parallel_size "
                     f"{g.infer_expert_parallel_size}: {per_g} per rank; {source}")
    return lines
