"""Parameters and device memory per rank, estimated for the dry run (the heaviest rank).

`parameters_per_rank` counts the parameters of the training sharding (dense, expert, LoRA
adapters) and of vLLM's; `memory_bytes` what each role's state and the update's
activations take on a rank; `phase_bytes` what each phase holds on the device.
Communication buffers and framework overhead are not counted.
"""

from __future__ import annotations

import math

from mindspeed_rl.config.batch_plan import longest_row
from mindspeed_rl.config.preference import PAIR
from mindspeed_rl.config.model_spec import ModelSpec
from mindspeed_rl.config.rank_parameters import padded_vocab_size, params_per_rank
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.config.teacher import teacher_parameters
from mindspeed_rl.parallel.layout import ParallelLayout, pipeline_stage_layers


def parameters_per_rank(config: RLJobConfig, layout: ParallelLayout) -> dict[str, int]:
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


def memory_bytes(config: RLJobConfig, layout: ParallelLayout,
                 parameters: dict[str, int]) -> dict[str, int]:
    """Device bytes per rank of each role's state (the update's activations included)."""
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
    else:
        optimizer = train_params * optim_bytes
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
                             if config.features.reference and not rl.share_backbone else 0),
    }
    if config.features.engine:  # a job that never generates builds no vLLM engine
        memory["vllm_weights"] = parameters["generation_per_rank"] * infer_bytes
        memory["kv_cache"] = (g.max_num_seqs * g.max_model_len * m.num_hidden_layers
                              * _kv_entries_per_token_and_layer(config, layout) * infer_bytes)
    memory.update(_activation_bytes(config, layout))
    if config.critic_config is not None:
        # Same body as the actor; its scalar head is negligible next to the LM head it lacks.
        memory["critic"] = train_params * (train_bytes + 4) + optimizer
    if config.reward_config is not None:
        memory["reward_model"] = train_params * train_bytes
    if config.teacher_config is not None:
        memory["teacher"] = teacher_parameters(config) * train_bytes
    return memory


def update_micro_batch_tokens(config: RLJobConfig) -> int:
    """Tokens of the largest update micro-batch: the packing budget with use_dynamic_bsz,
    else micro_batch_size rows of the longest row (prompt + response, within max_model_len;
    DPO: micro_batch_size pairs of two sequences of up to seq_length tokens)."""
    rl = config.rl_config
    longest = longest_row(config)
    if config.features.pairs:
        longest = PAIR * config.megatron_training.seq_length
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
    return 2 * kv_heads_per_generation_rank(config, layout) * m.kv_channels


def kv_heads_per_generation_rank(config: RLJobConfig, layout: ParallelLayout) -> int:
    """The KV heads one vLLM rank holds (vLLM replicates KV heads when TP_g > kv heads)."""
    return max(config.model.num_kv_heads // layout.infer_tensor_parallel_size, 1)


def phase_bytes(g, memory: dict[str, int]) -> dict[str, int]:
    """Device bytes per rank in each phase, from the roles' bytes."""
    training = memory["actor_params"] + memory["actor_grads"] + memory["actor_optimizer"]
    kept = (0 if g.offload_train_param else memory["actor_params"]) + (
        0 if g.offload_train_grad else memory["actor_grads"]) + (
        0 if g.offload_train_optimizer else memory["actor_optimizer"])
    if "vllm_weights" not in memory:  # no engine
        return {"training_phase": training}
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
