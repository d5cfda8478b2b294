"""The dry run's text: the plan as the table ``--dry-run`` and the launchers print
(`format_plan`), and the words it is made of: the memory table's labels (`memory_labels`)
and the weights the run loads (`weight_lines`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.plan_layout import reference_own_layout
from mindspeed_rl.config.plan_memory import kv_heads_per_generation_rank, update_micro_batch_tokens
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.config.teacher import teacher_sizes
from mindspeed_rl.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from mindspeed_rl.config.plan import Plan

GIB = 1024 ** 3


def format_plan(plan: Plan, header: str | None = None) -> str:
    """``plan`` as a readable table (what ``--dry-run`` prints, ``Plan.format``; a launcher
    passes its own ``header``)."""
    if header is None:
        header = (f"dry-run OK: {plan.config_path} on {plan.world_size} ranks "
                  "(nothing started, no weights read)")
    lines = [header, *(f"warning: {line}" for line in plan.warnings), ""]
    lines += _model_lines(plan.model) + _layout_lines(plan)
    lines += ["initial weights"] + [f"  {line}" for line in plan.weights] + [""]
    if plan.phases:
        lines += [f"phases: {' -> '.join(plan.phases)}", *([plan.rollout] if plan.rollout
                                                          else []),
                  *([plan.profiler] if plan.profiler else []), ""]
    rows = _pair_rows(plan.samples) if plan.pairs else _sample_rows(plan.samples)
    # one label column for the samples, micro-batches and parameters tables
    width = max(len(label) for label, _ in rows) + 2
    lines.append("samples per iteration")
    lines += [f"  {label:<{width}}{value:>8,}" for label, value in rows]
    lines.append("")
    lines += _micro_batch_lines(plan, width) + _parameter_lines(plan.parameters, width,
                                                                plan.engine)
    lines += _memory_lines(plan)
    if plan.notices:
        lines += ["", f"MindSpeed-RL keys translated, or accepted without effect here "
                      f"({len(plan.notices)}):"]
        lines += [f"  {line}" for line in plan.notices]
    return "\n".join(lines)


def _model_lines(model: dict) -> list[str]:
    return [f"model       {model['source']}",
            f"            {model['description']}",
            f"            {model['num_parameters']:,} parameters "
            f"({model['num_parameters'] / 1e9:.2f} B)", ""]


def _layout_lines(plan: Plan) -> list[str]:
    """The training and generation (when a vLLM engine is built) layouts, one row each,
    and the layout in words."""
    lay = plan.layout
    sp = "on" if lay.sequence_parallel else "off"
    generation = [f"  generation (vLLM)    {lay.infer_tensor_parallel_size:>4} {'-':>4} {1:>4} "
                  f"{lay.infer_data_parallel_size:>4} "
                  f"{plan.infer_expert_parallel_size or '-':>4}    -"] if plan.engine else []
    return ["layouts                  TP   CP   PP   DP   EP   SP",
            f"  training (megatron)  {lay.tensor_model_parallel_size:>4} "
            f"{lay.context_parallel_size:>4} "
            f"{lay.pipeline_model_parallel_size:>4} {lay.data_parallel_size:>4} "
            f"{lay.expert_model_parallel_size:>4} {sp:>4}",
            *generation, *(f"  {line}" for line in plan.layout_notes), ""]


def _sample_rows(s: dict[str, int]) -> list[tuple[str, int]]:
    """The samples table's rows: (label, count); the critic's only when there is one."""
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
    return rows


def _pair_rows(s: dict[str, int]) -> list[tuple[str, int]]:
    """The samples table of a DPO job: pairs, their two rows each, one optimizer step."""
    return [
        ("pairs (megatron_training.global_batch_size)", s["prompts_per_iteration"]),
        ("rows (chosen + rejected)", s["responses_per_iteration"]),
        ("rows per training-DP rank (whole pairs)", s["responses_per_training_dp_rank"]),
        ("optimizer steps per iteration", s["optimizer_steps_per_iteration"]),
        ("micro-batches per step (actor_config.micro_batch_size pairs)",
         s["micro_batches_per_mini_batch"]),
        ("ref log-prob forward micro-batches per training-DP rank",
         s["ref_logprob_micro_batches_per_training_dp_rank"]),
    ]


def _micro_batch_lines(plan: Plan, width: int) -> list[str]:
    """Each micro-batch phase's layout, when one packs rows or has a token budget."""
    layouts = {phase: m for phase, m in plan.batch.micro_batching.items()
               if phase in plan.micro_batch_phases or not plan.micro_batch_phases}
    if not any(m.dynamic or m.packed for m in layouts.values()):
        return []
    return ["micro-batches (rl_config.use_dynamic_bsz / use_remove_padding)",
            *(f"  {phase:<{width}}{m.describe():>8}" for phase, m in layouts.items()), ""]


def _parameter_lines(p: dict[str, int], width: int, engine: bool) -> list[str]:
    return ["parameters per rank (heaviest pipeline stage)",
            f"  {'training (actor, reference)':<{width}}{p['training_per_rank']:>14,}",
            *([f"  {'LoRA adapters (trained)':<{width}}{p['adapter_per_rank']:>14,}"]
              if p.get("adapter_per_rank") else []),
            *([f"  {'generation (vLLM)':<{width}}{p['generation_per_rank']:>14,}"]
              if engine else []), ""]


def _memory_lines(plan: Plan) -> list[str]:
    """The memory table: each role's bytes, then each phase's, in GiB."""
    mem_width = max(len(label) for label in plan.labels.values()) + 2
    lines = [f"{'memory per rank (estimate)':<{mem_width + 2}}{'GiB':>9}"]
    for key, value in plan.memory_bytes.items():
        lines.append(f"  {plan.labels[key]:<{mem_width}}{value / GIB:>9.2f}")
    lines.append(f"  {'-' * (mem_width + 9)}")
    for key, value in plan.phase_bytes.items():
        lines.append(f"  {plan.labels[key]:<{mem_width}}{value / GIB:>9.2f}")
    lines.append("  activations are not in the phase sums; not included: communication "
                 "buffers, framework overhead")
    return lines


def memory_labels(config: RLJobConfig, layout: ParallelLayout) -> dict[str, str]:
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
        "actor_optimizer": _optimizer_label(config, layout) + (
            " of the LoRA adapters only" if a.lora_target_modules else ""),
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
                        f"{kv_heads_per_generation_rank(config, layout)} KV head(s)/rank)")),
        "training_phase": "training phase (actor params + grads + optimizer)",
        "generation_phase": "generation phase (vLLM + training state not offloaded: "
                            + ("none" if len(offloaded) == 3 else
                               ", ".join(k for k in ("params", "grads", "optimizer")
                                         if k not in offloaded)) + ")",
        "device_memory_for_vllm": "device memory vLLM needs (weights + KV cache) / "
                                  f"gpu_memory_utilization={g.gpu_memory_utilization:g}",
    }


def _optimizer_label(config: RLJobConfig, layout: ParallelLayout) -> str:
    mt = config.megatron_training
    where = (f"distributed over DP={layout.data_parallel_size}"
             if mt.use_distributed_optimizer else "replicated")
    return f"optimizer (Adam, fp32{' master +' if mt.bf16 else ''} m, v; {where})"


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
    own = reference_own_layout(config)
    where = (f", its own TP={own[0]} PP={own[1]}; estimated at the actor's sharding"
             if own else "")
    return f"reference model ({train_dtype}{where}; on host when idle)"


def weight_lines(hf_dir: str | None, load: str | None, ref_load: str | None, finetune: bool,
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
