"""The dry-run: check a loaded config against a world size and estimate per-rank memory.

`make_plan(config, world_size)` is pure arithmetic (no torch, no processes, no
weights). Launchers call it with the torchrun world size before creating any
process group, so layout and batch errors surface as one clear message; the
``--dry-run`` CLI prints it for a world size of the user's choosing. The runtime batch
plan it holds is `config/batch_plan.py`'s.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from mindspeed_rl.config.batch_plan import BatchPlan, packing_budgets
from mindspeed_rl.config.deepseek_checks import mla_tensor_parallel_problem
from mindspeed_rl.config.errors import ConfigError
from mindspeed_rl.config.layout_notes import layout_notes
from mindspeed_rl.config.model_spec import ModelSpec
from mindspeed_rl.config.rank_parameters import padded_vocab_size, params_per_rank
from mindspeed_rl.config.teacher import (check_teacher_world, teacher_parameters, teacher_sizes,
                                         teacher_weight_line)
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout, pipeline_stage_layers

GIB = 1024 ** 3

# ParallelLayout names its keys without section; the user wrote them in these sections.
_LAYOUT_KEYS = {
    "world_size": "world_size",
    "tensor_model_parallel_size": "actor_config.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "actor_config.pipeline_model_parallel_size",
    "context_parallel_size": "actor_config.context_parallel_size",
    "context_parallel_algo": "actor_config.context_parallel_algo",
    "expert_model_parallel_size": "actor_config.expert_model_parallel_size",
    "expert_tensor_parallel_size": "actor_config.expert_tensor_parallel_size",
    "sequence_parallel": "megatron_training.sequence_parallel",
    "infer_tensor_parallel_size": "generate_config.infer_tensor_parallel_size",
    "num_layers": "num_hidden_layers",    # megatron's name; the model files use HF names
    "num_layer_list": "actor_config.num_layer_list",
}


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
    rollout: str = ""                  # the composed rollout, in words

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
            "notices": list(self.notices),
            "warnings": list(self.warnings),
        }

    def format(self, header: str | None = None) -> str:
        """The plan as a readable table (what ``--dry-run`` prints; a launcher passes its
        own ``header``)."""
        lay, s = self.layout, self.samples
        if header is None:
            header = (f"dry-run OK: {self.config_path} on {self.world_size} ranks "
                      "(nothing started, no weights read)")
        lines = [header, *(f"warning: {line}" for line in self.warnings), ""]
        lines += [f"model       {self.model['source']}",
                  f"            {self.model['description']}",
                  f"            {self.model['num_parameters']:,} parameters "
                  f"({self.model['num_parameters'] / 1e9:.2f} B)", ""]
        sp = "on" if lay.sequence_parallel else "off"
        lines += ["layouts                  TP   CP   PP   DP   EP   SP",
                  f"  training (megatron)  {lay.tensor_model_parallel_size:>4} "
                  f"{lay.context_parallel_size:>4} "
                  f"{lay.pipeline_model_parallel_size:>4} {lay.data_parallel_size:>4} "
                  f"{lay.expert_model_parallel_size:>4} {sp:>4}",
                  f"  generation (vLLM)    {lay.infer_tensor_parallel_size:>4} {'-':>4} {1:>4} "
                  f"{lay.infer_data_parallel_size:>4} "
                  f"{self.infer_expert_parallel_size or '-':>4}    -",
                  *(f"  {line}" for line in self.layout_notes), ""]
        lines += ["initial weights"] + [f"  {line}" for line in self.weights] + [""]
        if self.phases:
            lines += [f"phases: {' -> '.join(self.phases)}", self.rollout, ""]
        rows = [
            ("prompts (megatron_training.global_batch_size)", s["prompts_per_iteration"]),
            ("responses (x rl_config.n_samples_per_prompt)", s["responses_per_iteration"]),
            ("prompts per generation round (rl_config.gen_batch_size)",
             s["prompts_per_generation_round"]),
            ("prompts per generation-DP rank (each round)", s["prompts_per_generation_dp_rank"]),
            ("responses per generation-DP rank (each round)",
             s["responses_per_generation_dp_rank"]),
            ("responses per training-DP rank", s["responses_per_training_dp_rank"]),
            ("mini-batches per epoch (rl_config.mini_batch_size prompts)",
             s["mini_batches_per_epoch"]),
            ("optimizer steps per iteration (x rl_config.epochs)",
             s["optimizer_steps_per_iteration"]),
            ("responses per mini-batch per training-DP rank",
             s["responses_per_mini_batch_per_training_dp_rank"]),
            ("micro-batches per mini-batch (actor_config.micro_batch_size)",
             s["micro_batches_per_mini_batch"]),
            ("old log-prob forward micro-batches per training-DP rank",
             s["old_logprob_micro_batches_per_training_dp_rank"]),
            ("ref log-prob forward micro-batches per training-DP rank",
             s["ref_logprob_micro_batches_per_training_dp_rank"]),
        ]
        if s["critic_micro_batches_per_mini_batch"]:
            rows += [("critic micro-batches per mini-batch (critic_config.micro_batch_size)",
                      s["critic_micro_batches_per_mini_batch"]),
                     ("value forward micro-batches per training-DP rank",
                      s["value_micro_batches_per_training_dp_rank"])]
        width = max(len(label) for label, _ in rows) + 2
        lines.append("samples per iteration")
        lines += [f"  {label:<{width}}{value:>8,}" for label, value in rows]
        lines.append("")
        layouts = {phase: m for phase, m in self.batch.micro_batching.items()
                   if phase in self.micro_batch_phases or not self.micro_batch_phases}
        if any(m.dynamic or m.packed for m in layouts.values()):
            lines.append("micro-batches (rl_config.use_dynamic_bsz / use_remove_padding)")
            lines += [f"  {phase:<{width}}{m.describe():>8}" for phase, m in layouts.items()]
            lines.append("")
        p = self.parameters
        lines += ["parameters per rank (heaviest pipeline stage)",
                  f"  {'training (actor, reference)':<{width}}{p['training_per_rank']:>14,}",
                  *([f"  {'LoRA adapters (trained)':<{width}}{p['adapter_per_rank']:>14,}"]
                    if p.get("adapter_per_rank") else []),
                  f"  {'generation (vLLM)':<{width}}{p['generation_per_rank']:>14,}", ""]
        mem_width = max(len(label) for label in self.labels.values()) + 2
        lines.append(f"{'memory per rank (estimate)':<{mem_width + 2}}{'GiB':>9}")
        for key, value in self.memory_bytes.items():
            lines.append(f"  {self.labels[key]:<{mem_width}}{value / GIB:>9.2f}")
        lines.append(f"  {'-' * (mem_width + 9)}")
        for key, value in self.phase_bytes.items():
            lines.append(f"  {self.labels[key]:<{mem_width}}{value / GIB:>9.2f}")
        lines.append("  activations are not in the phase sums; not included: communication "
                     "buffers, framework overhead")
        if self.notices:
            lines += ["", f"MindSpeed-RL keys translated, or accepted without effect here "
                          f"({len(self.notices)}):"]
            lines += [f"  {line}" for line in self.notices]
        return "\n".join(lines)

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


def accepted_world_sizes(config: RLJobConfig, count: int = 4, limit: int = 8192) -> list[int]:
    """The first ``count`` world sizes (up to ``limit``) for which ``config`` is valid."""
    step = _world_size_step(config)
    found = []
    for world_size in range(step, limit + 1, step):
        try:
            _checked_layout(config, world_size)
        except ConfigError:
            continue
        found.append(world_size)
        if len(found) == count:
            break
    return found


def _world_size_step(config: RLJobConfig) -> int:
    """Every valid world size is a multiple of this (TP x PP, EP x TP x PP and TP_g tile it)."""
    a, g = config.actor_config, config.generate_config
    tp_pp = (a.tensor_model_parallel_size * a.context_parallel_size
             * a.pipeline_model_parallel_size)
    etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size
    return math.lcm(tp_pp, a.expert_model_parallel_size * etp * a.pipeline_model_parallel_size,
                    g.infer_tensor_parallel_size * g.infer_expert_parallel_size)


def _layout_sizes(config: RLJobConfig, world_size: int) -> dict[str, Any]:
    a = config.actor_config
    return dict(world_size=world_size,
                tensor_model_parallel_size=a.tensor_model_parallel_size,
                pipeline_model_parallel_size=a.pipeline_model_parallel_size,
                expert_model_parallel_size=a.expert_model_parallel_size,
                expert_tensor_parallel_size=a.expert_tensor_parallel_size,
                sequence_parallel=config.megatron_training.sequence_parallel,
                infer_tensor_parallel_size=config.generate_config.infer_tensor_parallel_size,
                context_parallel_size=a.context_parallel_size)


def _checked_layout(config: RLJobConfig, world_size: int) -> ParallelLayout:
    a, g, m = config.actor_config, config.generate_config, config.model
    try:
        # Model divisibility does not depend on the world size: check it first, on the
        # smallest world the parallel sizes tile, so the error points at the real culprit.
        smallest = ParallelLayout(**_layout_sizes(config, _world_size_step(config)))
        smallest.check_model(num_attention_heads=m.num_attention_heads,
                             num_query_groups=m.num_kv_heads, num_layers=m.num_hidden_layers,
                             num_experts=m.num_experts if m.is_moe else None,
                             num_layer_list=a.num_layer_list,
                             context_parallel_algo=a.context_parallel_algo)
        layout = ParallelLayout(**_layout_sizes(config, world_size))
    except LayoutError as e:
        raise ConfigError(None, _with_sections(str(e))) from None
    if m.is_mla:
        problem = mla_tensor_parallel_problem(m, a.tensor_model_parallel_size,
                                              "actor_config.tensor_model_parallel_size")
        if problem is not None:
            raise problem

    gbs, n = config.megatron_training.global_batch_size, config.rl_config.n_samples_per_prompt
    mini = config.rl_config.mini_batch_size
    dp_g, tpg = layout.infer_data_parallel_size, g.infer_tensor_parallel_size
    gen = config.rl_config.gen_batch_size
    if gen is not None and gen % dp_g:
        raise ConfigError(
            "rl_config.gen_batch_size", f"not divisible by the generation data-parallel size "
            f"{dp_g}: every vLLM instance must get the same number of prompts",
            f"use a multiple of {dp_g}, e.g. {_round_up(gen, dp_g)}", value=gen)
    if gbs % dp_g:
        raise ConfigError(
            "megatron_training.global_batch_size",
            f"not divisible by the generation data-parallel size {dp_g} (world size "
            f"{world_size} / generate_config.infer_tensor_parallel_size={tpg}): every vLLM "
            "instance must get the same number of prompts",
            f"use a multiple of {dp_g} that rl_config.mini_batch_size={mini} divides, e.g. "
            f"{_round_up(gbs, math.lcm(dp_g, mini))}", value=gbs)
    epg = g.infer_expert_parallel_size
    if dp_g % epg:
        raise ConfigError(
            "generate_config.infer_expert_parallel_size",
            f"does not divide the generation data-parallel size {dp_g} (world size {world_size} "
            f"/ generate_config.infer_tensor_parallel_size={tpg}): each expert-parallel group "
            "spans that many vLLM replicas", f"use a divisor of {dp_g}", value=epg)
    if g.enable_expert_parallel and m.is_moe and m.num_experts % (tpg * epg):
        raise ConfigError(
            "generate_config.infer_expert_parallel_size",
            f"vLLM's expert-parallel size infer_tensor_parallel_size={tpg} x {epg} = {tpg * epg} "
            f"does not divide the model's num_experts={m.num_experts}",
            "choose sizes whose product divides the experts", value=epg)
    dp, mbs = layout.data_parallel_size, a.micro_batch_size
    if (mini * n) % (dp * mbs):
        raise ConfigError(
            "rl_config.mini_batch_size",
            f"{mini} prompts x rl_config.n_samples_per_prompt={n} = {mini * n} responses per "
            f"optimizer step do not split into training data-parallel size {dp} x "
            f"actor_config.micro_batch_size={mbs} = {dp * mbs} per micro-batch round",
            f"make mini_batch_size x n_samples_per_prompt a multiple of {dp * mbs}", value=mini)
    critic = config.critic_config
    if critic is not None and (mini * n) % (dp * critic.micro_batch_size):
        cmbs = critic.micro_batch_size
        raise ConfigError(
            "critic_config.micro_batch_size",
            f"rl_config.mini_batch_size={mini} x n_samples_per_prompt={n} = {mini * n} responses "
            f"per critic step do not split into training data-parallel size {dp} x "
            f"critic_config.micro_batch_size={cmbs} = {dp * cmbs} per micro-batch round",
            f"use a micro_batch_size that divides {mini * n // dp}", value=cmbs)
    return layout


def _make_plan(config: RLJobConfig, world_size: int) -> Plan:
    """The plan in named steps: layout, batch, parameters per rank, memory, labels."""
    layout = _checked_layout(config, world_size)
    m, a, rl, g = config.model, config.actor_config, config.rl_config, config.generate_config
    batch = BatchPlan.of(config, layout)
    samples = {k: v for k, v in dataclasses.asdict(batch).items() if k != "micro_batching"}
    parameters = _parameters_per_rank(config, layout)
    memory, optim_label = _memory_bytes(config, layout, parameters)
    counts = m.parameter_counts()
    model = {"source": m.source, "description": m.describe(), "num_parameters": counts["total"],
             "parameter_counts": counts}
    tpg = layout.infer_tensor_parallel_size
    return Plan(config_path=config.config_path, world_size=world_size, layout=layout,
                batch=batch, model=model, samples=samples, parameters=parameters,
                memory_bytes=memory, phase_bytes=_phase_bytes(g, memory),
                labels=_memory_labels(config, layout, optim_label),
                weights=tuple(_weight_lines(m.hf_dir, a.load, config.ref_config.load,
                                            a.finetune, rl.init_kl_coef > 0,
                                            shared=rl.share_backbone)
                       + _reference_layout_lines(config, world_size)
                       + _teacher_lines(config, world_size)),
                notices=config.notices, warnings=config.warnings,
                micro_batch_phases=tuple(packing_budgets(config)),
                phases=config.features.phases, rollout=config.features.rollout.describe(),
                infer_expert_parallel_size=(tpg * g.infer_expert_parallel_size
                                            if g.enable_expert_parallel and m.is_moe else None),
                layout_notes=tuple(layout_notes(config, layout)))


def _parameters_per_rank(config: RLJobConfig, layout: ParallelLayout) -> dict[str, int]:
    """Parameters on one rank in the training sharding (dense and expert) and in vLLM's."""
    m, g = config.model, config.generate_config
    tp, pp, ep = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.expert_model_parallel_size)
    stages = pipeline_stage_layers(m.num_hidden_layers, pp, config.actor_config.num_layer_list)
    dense, expert = params_per_rank(m, tp=tp, pp=pp, ep=ep, expert_tp=layout.expert_tp,
                                    stage_layers=stages)
    tpg = layout.infer_tensor_parallel_size
    if g.enable_expert_parallel and m.is_moe:
        # vLLM expert parallelism: whole experts over TP_g x infer_expert_parallel_size ranks.
        dense_g, expert_g = params_per_rank(m, tp=tpg, pp=1, ep=tpg * g.infer_expert_parallel_size,
                                            expert_tp=1, split_down_projections=False)
    else:
        # Without it vLLM shards every expert over its TP ranks.
        dense_g, expert_g = params_per_rank(m, tp=tpg, pp=1, ep=1, expert_tp=tpg,
                                            split_down_projections=False)
    a = config.actor_config
    adapters = lora_params_per_rank(m, a.lora_target_modules, a.lora_r, tp=tp,
                                    layers=max(stages))
    return {"training_per_rank": dense + expert, "training_dense_per_rank": dense,
            "training_expert_per_rank": expert, "generation_per_rank": dense_g + expert_g,
            "adapter_per_rank": adapters}


def lora_params_per_rank(model: ModelSpec, targets, r: int, *, tp: int, layers: int) -> int:
    """LoRA adapter parameters on one rank holding ``layers`` decoder layers.

    A column-parallel linear (qkv, fc1) keeps A [r, in] whole and B [out/tp, r] split; a
    row-parallel one (proj, fc2) splits A [r, in/tp] and keeps B [out, r] whole
    (`mindspeed_rl.models.lora`).
    """
    h, d = model.hidden_size, model.kv_channels
    q_heads, kv_heads = model.num_attention_heads // tp, max(model.num_kv_heads // tp, 1)
    ffn = model.intermediate_size or 0
    per_layer = {"linear_qkv": r * h + (q_heads + 2 * kv_heads) * d * r,
                 "linear_proj": r * model.num_attention_heads * d // tp + h * r,
                 "linear_fc1": r * h + 2 * ffn // tp * r,
                 "linear_fc2": r * ffn // tp + h * r}
    return layers * sum(per_layer[t] for t in targets if t in per_layer)


def _memory_bytes(config: RLJobConfig, layout: ParallelLayout,
                  parameters: dict[str, int]) -> tuple[dict[str, int], str]:
    """Device bytes per rank of each role's state, and the optimizer's label."""
    mt, rl, g, m = (config.megatron_training, config.rl_config, config.generate_config,
                    config.model)
    train_params = parameters["training_per_rank"]
    dense, expert = parameters["training_dense_per_rank"], parameters["training_expert_per_rank"]
    dp = layout.data_parallel_size
    train_bytes = 2 if mt.bf16 else 4
    infer_bytes = 2 if config.generation_dtype == "bfloat16" else 4
    # Adam: exp_avg + exp_avg_sq in fp32, plus an fp32 master copy when params are bf16.
    optim_bytes = 12 if mt.bf16 else 8
    if mt.use_distributed_optimizer:
        # Dense state is sharded over DP, expert state over the expert-DP group.
        optimizer = -(-dense * optim_bytes // dp) + -(-expert * optim_bytes
                                                      // layout.expert_data_parallel_size)
        optim_label = (f"optimizer (Adam, fp32{' master +' if mt.bf16 else ''} m, v; "
                       f"distributed over DP={dp})")
    else:
        optimizer = train_params * optim_bytes
        optim_label = f"optimizer (Adam, fp32{' master +' if mt.bf16 else ''} m, v; replicated)"
    adapters = parameters["adapter_per_rank"]
    if adapters:
        # LoRA: the backbone is frozen; only the adapters have grads and optimizer state.
        optimizer = (-(-adapters * optim_bytes // dp) if mt.use_distributed_optimizer
                     else adapters * optim_bytes)
    memory = {
        "actor_params": (train_params + adapters) * train_bytes,
        # Megatron keeps main grads in fp32 (bf16 runs accumulate and reduce in fp32).
        "actor_grads": (adapters or train_params) * 4,
        "actor_optimizer": optimizer,
        "reference_params": (train_params * train_bytes
                             if rl.init_kl_coef > 0 and not rl.share_backbone else 0),
        "vllm_weights": parameters["generation_per_rank"] * infer_bytes,
        "kv_cache": (g.max_num_seqs * g.max_model_len * m.num_hidden_layers
                     * _kv_entries_per_token_and_layer(config, layout) * infer_bytes),
    }
    memory.update(_activation_bytes(config, layout))
    if config.critic_config is not None:
        # Same body as the actor; its scalar head is negligible next to the LM head it lacks.
        memory["critic"] = train_params * (train_bytes + 4) + optimizer
    if config.reward_config is not None:
        memory["reward_model"] = train_params * train_bytes
    if config.teacher_config is not None:
        memory["teacher"] = teacher_parameters(config) * train_bytes
    return memory, optim_label


def update_micro_batch_tokens(config: RLJobConfig) -> int:
    """Tokens of the largest update micro-batch: the packing budget with use_dynamic_bsz,
    else micro_batch_size rows of the longest prompt + response."""
    rl = config.rl_config
    longest = rl.max_prompt_length + config.features.response_limit
    if rl.use_dynamic_bsz:
        budget = rl.update_max_packing_token_size or rl.max_packing_token_size
        if budget:
            return budget
    return config.actor_config.micro_batch_size * longest


def _activation_bytes(config: RLJobConfig, layout: ParallelLayout) -> dict[str, int]:
    """Activations of the update on the heaviest rank: one micro-batch's tokens, split over
    CP (and over TP by sequence parallelism), through the first stage's layers, with as many
    micro-batches in flight as pipeline stages (1F1B); and the fp32 vocabulary logits of one
    micro-batch on the last stage.

    Per token and layer, 16-bit activations take 34 h / TP bytes with sequence parallelism,
    (10 + 24 / TP) h without (Korthikanti et al. 2022, "Reducing Activation Recomputation",
    Table 2, with a memory-linear attention kernel: no s^2 term); full recompute keeps each
    layer's input (2 h / TP, or 2 h) plus one layer's full set; fp32 doubles it.
    """
    m, a, mt = config.model, config.actor_config, config.megatron_training
    tp, cp, pp = (layout.tensor_model_parallel_size, layout.context_parallel_size,
                  layout.pipeline_model_parallel_size)
    tokens = -(-update_micro_batch_tokens(config) // cp)
    h, scale = m.hidden_size, (1 if mt.bf16 else 2)
    sp = layout.sequence_parallel
    per_layer = tokens * h * (34 / tp if sp else 10 + 24 / tp) * scale
    layers = max(pipeline_stage_layers(m.num_hidden_layers, pp, a.num_layer_list))
    if a.recompute_granularity == "full":
        kept = tokens * h * (2 / tp if sp else 2) * scale
        stage = kept * layers + per_layer
    else:
        stage = per_layer * layers
    return {"activations": int(stage * pp),
            "logits": tokens * padded_vocab_size(m.vocab_size) // tp * 4}


def _kv_entries_per_token_and_layer(config: RLJobConfig, layout: ParallelLayout) -> int:
    """What vLLM caches per token and layer on one rank: keys and values of its KV heads, or
    multi-latent attention's latent + RoPE key (kv_lora_rank + qk_rope_head_dim), which
    every TP rank caches whole."""
    m = config.model
    if m.is_mla:
        return m.kv_latent_dim
    return 2 * _kv_heads_per_generation_rank(config, layout) * m.kv_channels


def _kv_heads_per_generation_rank(config: RLJobConfig, layout: ParallelLayout) -> int:
    # vLLM replicates KV heads when TP_g > kv heads
    return max(config.model.num_kv_heads // layout.infer_tensor_parallel_size, 1)


def _phase_bytes(g, memory: dict[str, int]) -> dict[str, int]:
    """Device bytes per rank in each phase, from the roles' bytes."""
    training = memory["actor_params"] + memory["actor_grads"] + memory["actor_optimizer"]
    kept = (0 if g.offload_train_param else memory["actor_params"]) + (
        0 if g.offload_train_grad else memory["actor_grads"]) + (
        0 if g.offload_train_optimizer else memory["actor_optimizer"])
    return {
        "training_phase": training,
        "generation_phase": memory["vllm_weights"] + memory["kv_cache"] + kept,
        **({"critic_phase": training + memory["critic"]} if "critic" in memory else {}),
        **({"teacher_phase": training + memory["teacher"]} if "teacher" in memory else {}),
        # vLLM sizes itself as a fraction of the device: the device it needs to hold its
        # weights plus a KV cache for max_num_seqs full-length sequences.
        "device_memory_for_vllm": math.ceil((memory["vllm_weights"] + memory["kv_cache"])
                                            / g.gpu_memory_utilization),
    }


def _memory_labels(config: RLJobConfig, layout: ParallelLayout,
                   optim_label: str) -> dict[str, str]:
    """What each line of the memory plan counts."""
    mt, rl, g, m = (config.megatron_training, config.rl_config, config.generate_config,
                    config.model)
    train_dtype = "bf16" if mt.bf16 else "fp32"
    a = config.actor_config
    tp, pp, ep = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.expert_model_parallel_size)
    lora = (f" + LoRA r={a.lora_r} on {'/'.join(a.lora_target_modules)}"
            if a.lora_target_modules else "")
    offloaded = [name for name, flag in (("params", g.offload_train_param),
                                         ("grads", g.offload_train_grad),
                                         ("optimizer", g.offload_train_optimizer)) if flag]
    return {
        "actor_params": f"actor params ({train_dtype}, TP={tp} PP={pp}"
                        + (f" EP={ep}" if m.is_moe else "") + lora + ")",
        "actor_grads": ("actor grads (fp32 main grads of the LoRA adapters only)"
                        if a.lora_target_modules else "actor grads (fp32 main grads)"),
        "actor_optimizer": optim_label + (" of the LoRA adapters only"
                                          if a.lora_target_modules else ""),
        "reference_params": _reference_label(config, train_dtype),
        "activations": (f"activations (update micro-batch: {update_micro_batch_tokens(config):,}"
                        f" tokens / CP={layout.context_parallel_size}, {pp} in flight"
                        + (", full recompute" if a.recompute_granularity == "full" else "")
                        + ")"),
        "logits": f"output logits (fp32, one micro-batch / CP over vocab / TP={tp})",
        "vllm_weights": f"vLLM weights ({config.generation_dtype}, "
                        f"TP_g={layout.infer_tensor_parallel_size})",
        "critic": "critic (params + fp32 grads + optimizer; on host when idle)",
        "critic_phase": "critic phases (actor training state + critic)",
        "teacher_phase": "teacher phase (actor training state + teacher)",
        "reward_model": f"reward model ({train_dtype}; on host when idle)",
        "teacher": _teacher_label(config, train_dtype),
        "kv_cache": (f"vLLM KV cache ({g.max_num_seqs} seqs x {g.max_model_len} tokens, "
                     + (f"MLA latent {m.kv_latent_dim}/token/layer, whole on each rank)"
                        if m.is_mla else
                        f"{_kv_heads_per_generation_rank(config, layout)} KV head(s)/rank)")),
        "training_phase": "training phase (actor params + grads + optimizer)",
        "generation_phase": "generation phase (vLLM + training state not offloaded: "
                            + ("none" if len(offloaded) == 3 else
                               ", ".join(k for k in ("params", "grads", "optimizer")
                                         if k not in offloaded)) + ")",
        "device_memory_for_vllm": "device memory vLLM needs (weights + KV cache) / "
                                  f"gpu_memory_utilization={g.gpu_memory_utilization:g}",
    }


def _teacher_lines(config: RLJobConfig, world_size: int) -> list[str]:
    if config.teacher_config is None:
        return []
    check_teacher_world(config, world_size)
    return [teacher_weight_line(config, world_size)]


def _teacher_label(config: RLJobConfig, train_dtype: str) -> str:
    if config.teacher_config is None:
        return ""
    tp, pp = teacher_sizes(config)
    return f"distillation teacher ({train_dtype}, TP={tp} PP={pp}; on host when idle)"


def _reference_label(config: RLJobConfig, train_dtype: str) -> str:
    rl = config.rl_config
    if rl.init_kl_coef <= 0:
        return "reference model (init_kl_coef=0: none)"
    if rl.share_backbone:
        return "reference model (share_backbone: the actor with its adapters off; no weights)"
    own = _reference_own_layout(config)
    where = (f", its own TP={own[0]} PP={own[1]}; estimated at the actor's sharding"
             if own else "")
    return f"reference model ({train_dtype}{where}; on host when idle)"


def _reference_own_layout(config: RLJobConfig) -> tuple[int, int] | None:
    """ref_config's own (TP, PP) when it differs from the actor's, else None."""
    r, a = config.ref_config, config.actor_config
    tp = r.tensor_model_parallel_size or a.tensor_model_parallel_size
    pp = r.pipeline_model_parallel_size or a.pipeline_model_parallel_size
    same = (tp, pp) == (a.tensor_model_parallel_size, a.pipeline_model_parallel_size)
    return None if same or config.rl_config.init_kl_coef <= 0 else (tp, pp)


def _reference_layout_lines(config: RLJobConfig, world_size: int) -> list[str]:
    """The reference's own layout (ref_config's TP x PP): it must tile the world and split
    the model as the actor's does."""
    own = _reference_own_layout(config)
    if own is None:
        return []
    tp, pp = own
    m = config.model
    for bad, key, why in (
            (world_size % (tp * pp), "tensor_model_parallel_size",
             f"TP={tp} x PP={pp} does not divide the world of {world_size} ranks"),
            (m.num_attention_heads % tp or m.num_kv_heads % tp and tp % m.num_kv_heads,
             "tensor_model_parallel_size", f"TP={tp} does not split the model's "
             f"{m.num_attention_heads} query / {m.num_kv_heads} KV heads"),
            (m.is_mla and mla_tensor_parallel_problem(m, tp, "") is not None,
             "tensor_model_parallel_size", f"TP={tp} does not split the model's multi-latent "
             f"attention down projections (q_lora_rank={m.q_lora_rank}, kv_lora_rank + "
             f"qk_rope_head_dim={m.kv_latent_dim})"),
            (pp > m.num_hidden_layers, "pipeline_model_parallel_size",
             f"PP={pp} exceeds the model's {m.num_hidden_layers} layers")):
        if bad:
            raise ConfigError(f"ref_config.{key}", why, "give the reference a TP x PP that "
                              "tiles the world and splits the model, or remove the key to run "
                              "it in the actor's layout", value=tp if "tensor" in key else pp)
    return [f"reference  runs in its own layout: TP {tp} x PP {pp} x DP {world_size // (tp * pp)} "
            "over the actor's ranks (ref_config, MindSpeed-RL's separate reference worker)"]


def _weight_lines(hf_dir: str | None, load: str | None, ref_load: str | None, finetune: bool,
                  kl: bool, shared: bool = False) -> list[str]:
    """Which weights the run loads, by the rule of mindspeed_rl.checkpoint.weight_source
    (stated here without reading any file)."""
    if load:
        actor = (f"actor_config.load={load}: resumed if it holds a checkpoint saved here"
                 + (" (finetune: its weights only, from iteration 0)" if finetune else "")
                 + ", else its weights")
        if hf_dir:
            actor += "; the safetensors of megatron_training.model are not read"
    elif hf_dir:
        actor = f"the safetensors of megatron_training.model={hf_dir}"
    else:
        actor = "none found: set actor_config.load (megatron_training.model is a model yaml)"
    lines = [f"actor      {actor}"]
    if kl and shared:
        lines.append("reference  none loaded: share_backbone runs the actor's backbone with "
                     "its LoRA adapters off")
    elif kl:
        lines.append("reference  " + (f"ref_config.load={ref_load}" if ref_load else
                                      "the weights the run started from (recorded in every "
                                      "checkpoint, so a resumed run keeps them)"))
    return lines


def _with_sections(message: str) -> str:
    """Rewrite ParallelLayout's bare key names into the dotted keys of the YAML."""
    return re.sub(r"\b(" + "|".join(_LAYOUT_KEYS) + r")\b",
                  lambda match: _LAYOUT_KEYS[match.group(1)], message)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
