"""The dry-run: check a loaded config against a world size and estimate per-rank memory.

`make_plan(config, world_size)` is pure arithmetic (no torch, no processes, no
weights). Launchers call it with the torchrun world size before creating any
process group, so layout and batch errors surface as one clear message; the
``--dry-run`` CLI prints it for a world size of the user's choosing.

The `Plan` gathers the checked layout (`config/plan_layout.py`), the runtime batch plan
(`config/batch_plan.py`) and the parameters and memory per rank (`config/plan_memory.py`);
its text is `config/plan_text.py`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mindspeed_rl.algorithms.phase_names import ROLLOUT
from mindspeed_rl.config.batch_plan import BatchPlan, packing_budgets
from mindspeed_rl.config.config_error import ConfigError
from mindspeed_rl.config.layout_notes import layout_notes
from mindspeed_rl.config.plan_layout import (accepted_world_sizes, checked_layout,
                                             reference_layout_lines)
from mindspeed_rl.config.plan_memory import memory_bytes, parameters_per_rank, phase_bytes
from mindspeed_rl.config.plan_text import format_plan, memory_labels, weight_lines
from mindspeed_rl.config.profiling import profiler_line
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.config.teacher import check_teacher_world, teacher_weight_line
from mindspeed_rl.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Plan:
    """What one iteration of a job does on ``world_size`` ranks, and what it costs per rank.

    ``samples`` counts prompts/responses/batches (exact). ``parameters`` and
    ``memory_bytes`` are per-rank estimates for the heaviest rank (the pipeline
    stage holding the embedding or output layer); activations, communication
    buffers and framework overhead are not included.
    """

    config_path: str
    world_size: int
    layout: ParallelLayout
    batch: BatchPlan
    model: dict[str, Any]
    samples: dict[str, int]
    parameters: dict[str, int]
    memory_bytes: dict[str, int]
    phase_bytes: dict[str, int]
    labels: dict[str, str] = field(repr=False)  # memory/phase key -> table label
    weights: tuple[str, ...] = ()      # which weights the run loads (the stated rule)
    notices: tuple[str, ...] = ()      # MindSpeed-RL keys accepted without effect, and why
    warnings: tuple[str, ...] = ()     # values run as MindSpeed-RL runs them, though odd
    # the phases of this job that run megatron micro-batches (the others are not shown)
    micro_batch_phases: tuple[str, ...] = ()
    infer_expert_parallel_size: int | None = None   # vLLM EP size, None without EP
    # the layout in words: uneven pipeline stages, where the experts live (training and vLLM)
    layout_notes: tuple[str, ...] = ()
    phases: tuple[str, ...] = ()       # the phases the job runs, in order
    rollout: str = ""                  # the composed rollout, in words ("" without one)
    pairs: bool = False                # rows are preference pairs (DPO)
    engine: bool = True                # a vLLM engine is built
    profiler: str = ""                 # what profiler_config records, in words ("" when off)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON-ready) of every number the table shows."""
        lay = self.layout
        return {
            "config_path": self.config_path,
            "world_size": self.world_size,
            "layout": {
                "training": {"tensor_model_parallel_size": lay.tensor_model_parallel_size,
                             "context_parallel_size": lay.context_parallel_size,
                             "pipeline_model_parallel_size": lay.pipeline_model_parallel_size,
                             "data_parallel_size": lay.data_parallel_size,
                             "expert_model_parallel_size": lay.expert_model_parallel_size,
                             "expert_data_parallel_size": lay.expert_data_parallel_size,
                             "sequence_parallel": lay.sequence_parallel},
                "generation": {"infer_tensor_parallel_size": lay.infer_tensor_parallel_size,
                               "data_parallel_size": lay.infer_data_parallel_size},
            },
            "model": dict(self.model),
            "samples": dict(self.samples),
            "parameters": dict(self.parameters),
            "memory_bytes": dict(self.memory_bytes),
            "phase_bytes": dict(self.phase_bytes),
            "layout_notes": list(self.layout_notes),
            "weights": list(self.weights),
            "phases": list(self.phases),
            "rollout": self.rollout,
            "profiler": self.profiler,
            "notices": list(self.notices),
            "warnings": list(self.warnings),
        }

    def format(self, header: str | None = None) -> str:
        """The plan as a readable table (what ``--dry-run`` prints; a launcher passes its
        own ``header``): `config/plan_text.py`'s `format_plan`."""
        return format_plan(self, header)

    __str__ = format


def make_plan(config: RLJobConfig, world_size: int) -> Plan:
    """Validate ``config`` for ``world_size`` ranks and return its plan.

    Checks the training and generation layouts (ParallelLayout), the model's
    divisibility by TP / PP / EP / TP_g (ParallelLayout.check_model) and the
    batch splits over data-parallel ranks.

    Raises:
        ConfigError: naming the keys at fault; when other world sizes would
            work, the fix lists a few of them.
    """
    try:
        return _make_plan(config, world_size)
    except ConfigError as error:
        accepted = accepted_world_sizes(config)
        if accepted and world_size not in accepted:
            raise error.with_fix("world sizes this config accepts: "
                                 + ", ".join(map(str, accepted)) + ", ...") from None
        raise


def _make_plan(config: RLJobConfig, world_size: int) -> Plan:
    """The plan in named steps: layout, batch, parameters per rank, memory, labels."""
    layout = checked_layout(config, world_size)
    m, a, rl, g = config.model, config.actor_config, config.rl_config, config.generate_config
    batch = BatchPlan.of(config, layout)
    samples = {k: v for k, v in dataclasses.asdict(batch).items() if k != "micro_batching"}
    parameters = parameters_per_rank(config, layout)
    memory = memory_bytes(config, layout, parameters)
    counts = m.parameter_counts()
    model = {"source": m.source, "description": m.describe(), "num_parameters": counts["total"],
             "parameter_counts": counts}
    tpg = layout.infer_tensor_parallel_size
    return Plan(config_path=config.config_path, world_size=world_size, layout=layout,
                batch=batch, model=model, samples=samples, parameters=parameters,
                memory_bytes=memory, phase_bytes=phase_bytes(g, memory),
                labels=memory_labels(config, layout),
                weights=tuple(weight_lines(m.hf_dir, a.load, config.ref_config.load,
                                           a.finetune, config.features.reference,
                                           shared=rl.share_backbone)
                       + reference_layout_lines(config, world_size)
                       + _teacher_lines(config, world_size)),
                notices=config.notices, warnings=config.warnings,
                micro_batch_phases=tuple(packing_budgets(config)),
                phases=config.features.phases,
                rollout=(config.features.rollout.describe() if ROLLOUT in config.features.phases
                         else ""),
                pairs=config.features.pairs, engine=config.features.engine,
                infer_expert_parallel_size=(tpg * g.infer_expert_parallel_size
                                            if g.enable_expert_parallel and m.is_moe else None),
                layout_notes=tuple(layout_notes(config, layout)),
                profiler=profiler_line(config, world_size))


def _teacher_lines(config: RLJobConfig, world_size: int) -> list[str]:
    if config.teacher_config is None:
        return []
    check_teacher_world(config, world_size)
    return [teacher_weight_line(config, world_size)]
