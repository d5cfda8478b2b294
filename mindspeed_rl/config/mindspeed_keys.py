"""MindSpeed-RL's config keys, one row each: honoured, translated, or not applicable here.

A MindSpeed-RL GRPO config (``defaults:`` + ``megatron_training`` / ``actor_config`` /
``rl_config`` / ``generate_config``) loads as it is. Every key it may hold is one of:

- **honoured**: the same name means the same thing here (a key of the schema, possibly
  in a sibling section: MindSpeed-RL merges ``megatron_training`` into ``actor_config``,
  so a Megatron key may sit in either);
- **translated**: an older or MindSpeed-LLM name, rewritten into the schema's keys
  (``noop_layers`` + ``num_layers`` -> ``num_layer_list``, ``moe_tp_extend_ep`` ->
  ``expert_tensor_parallel_size``);
- **not applicable**: a kernel choice, a Ray setting, a dispatch chunk size... accepted
  and listed in one start-up notice with the reason. Where a value would change what the
  run computes and this project cannot do it (context parallelism, a PPO critic, DAPO's
  dynamic sampling...), that value is an error; the row says which values are harmless.

Keys that only older MindSpeed-RL versions had (its configs of March to May 2025 and the
keys its config classes dropped since) are rows too, with ``history`` saying which
versions read them, so a user's old file loads or is refused by name with its version.

``ROWS`` is the table. A later feature is one row flipped: e.g. when PPO lands,
``gamma`` moves from not-applicable to an honoured schema key. ``normalise`` applies the
table to a parsed YAML file and reports every problem of the file at once.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

from mindspeed_rl.config.config_error import ConfigError, show_value

# Where MindSpeed-RL reads a key. Megatron keys: megatron_training and actor_config are
# merged into one MegatronConfig there (actor_config wins), ref_config likewise.
MEGATRON = "megatron"
RL = "rl_config"
GENERATE = "generate_config"
SAMPLING = "generate_config.sampling_config"
TOP = "top level"
FAMILY_SECTIONS = {
    MEGATRON: ("megatron_training", "actor_config", "ref_config", "critic_config",
               "reward_config"),
    RL: ("rl_config",),
    GENERATE: ("generate_config",),
    SAMPLING: ("generate_config.sampling_config",),
}

HONOURED, TRANSLATED, NOT_APPLICABLE = "honoured", "translated", "not applicable"

# MindSpeed-RL's config classes read a '-' in a key as '_' (BaseConfig.update, since
# 2025-03-03), so Megatron's own spelling of its arguments (``min-lr``, as its argument parser
# takes them) works in every section they read: these, and a model yaml's body. Keys of
# generate_config.sampling_config go to vLLM's SamplingParams unchanged there.
UNDERSCORED_SECTIONS = ("megatron_training", "actor_config", "ref_config", "critic_config",
                        "reward_config", "rl_config", "generate_config")


def _any(value: Any) -> bool:
    return True


def _off(value: Any) -> bool:
    """Unset: null, false, 0, '' or an empty list/mapping."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return any(value == a and type(value) is type(a) or (value is a) for a in allowed) or (
            any(isinstance(a, float) and isinstance(value, int) and not isinstance(value, bool)
                and value == a for a in allowed))
    check.allowed = allowed  # type: ignore[attr-defined]
    return check


def _at_most_one(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value <= 1)


@dataclass(frozen=True)
class KeyRow:
    """How one MindSpeed-RL key is handled here."""

    family: str                    # MEGATRON, RL, GENERATE, SAMPLING or TOP
    name: str
    handling: str                  # HONOURED, TRANSLATED or NOT_APPLICABLE
    detail: str                    # honoured: the dotted key; otherwise the reason / rewrite
    accepts: Callable[[Any], bool] = _any   # not applicable: values that change nothing
    needs: str = ""                # what an accepted value looks like (for the error)
    history: str = ""              # an older key: the MindSpeed-RL versions that read it


def _na(family: str, names: str, reason: str, accepts: Callable[[Any], bool] = _any,
        needs: str = "", history: str = "") -> list[KeyRow]:
    return [KeyRow(family, n, NOT_APPLICABLE, reason, accepts, needs, history)
            for n in names.split()]


def _old(family: str, names: str, history: str, handling: str, reason: str,
         accepts: Callable[[Any], bool] = _any, needs: str = "") -> list[KeyRow]:
    """Keys of older MindSpeed-RL versions only (``history``: which ones)."""
    return [KeyRow(family, n, handling, reason, accepts, needs, history) for n in names.split()]


# The versions of MindSpeed-RL's keys that its config classes no longer have (read from its
# history: the commits that added and removed each key; 2.0.0 is its first release branch,
# 2025-05-30). Dates are of its master branch.
_MARCH_2025 = "MindSpeed-RL master 2025-03-11 to 2025-03-27, before release 2.0.0"
_EXPERIENCE_COUNT = "MindSpeed-RL master 2025-03-26 to 2025-05-15, before release 2.0.0"
_GEN_MBS = "MindSpeed-RL master 2025-03-20 to 2025-03-26, before release 2.0.0"
_UPDATE_MBS = "MindSpeed-RL master 2025-05-07 to 2025-05-21, before release 2.0.0"
# MindSpeed-RL's March 2025 configs carried these, but no version of its config classes
# had them: its classes then ignored keys they did not know (until 2025-06-19).
_NEVER_READ = ("in MindSpeed-RL's configs of March 2025, but never a key of its config "
               "classes (they ignored unknown keys until 2025-06-19)")


def _same(family: str, names: str, section: str) -> list[KeyRow]:
    return [KeyRow(family, n, HONOURED, f"{section}.{n}") for n in names.split()]


_KERNEL = "an Ascend/CUDA kernel or fusion choice; megatron-core's local (no Transformer " \
          "Engine) layers compute the same function"
_MEMORY = "a memory or overlap optimisation of MindSpeed; it does not change what is computed"
_RAY = "a Ray / worker-placement setting; here one SPMD torchrun program hosts every role " \
       "on every rank"
_DISPATCH = "a MindSpeed-RL TransferDock chunk size; here each get takes a data-parallel " \
            "rank's whole share, balanced by tokens, which computes the same batches"
_PACKING = "a packing/padding choice of Megatron's data loader; here rl_config." \
           "use_remove_padding / use_dynamic_bsz lay out the micro-batches, which compute the " \
           "same log-probs either way"
_LOGGING = "a logging or diagnostics choice (metrics always go to metrics.jsonl)"
_DATA_PREP = "a data-preprocessing setting (tools/preprocess_data.py writes the data)"
_MODEL_YAML = "a model-yaml (architecture) key; put it in configs/model/<name>.yaml"

ROWS: list[KeyRow] = [
    # ---- top level ----------------------------------------------------------------------
    KeyRow(TOP, "defaults", TRANSLATED, "hydra defaults list: its model names are looked up "
           "as model/<name>.yaml next to the config, megatron_training.model selects one"),
    *_na(TOP, "msprobe_config", "MindStudio's msprobe data dumps; not used here"),
    KeyRow(TOP, "profiler_config", HONOURED, "profiler_config.integrated"),

    # ---- Megatron keys (megatron_training / actor_config) ----------------------------------
    *_same(MEGATRON, "model tokenizer_name_or_path global_batch_size seq_length train_iters "
           "save_interval seed data_path bf16 use_distributed_optimizer sequence_parallel "
           "exit_duration_in_mins",
           "megatron_training"),
    *_same(MEGATRON, "micro_batch_size tensor_model_parallel_size pipeline_model_parallel_size "
           "expert_model_parallel_size lr min_lr lr_decay_style lr_warmup_fraction weight_decay "
           "clip_grad adam_beta1 adam_beta2 load save no_load_optim no_load_rng finetune "
           "recompute_granularity recompute_method recompute_num_layers num_layer_list "
           "moe_aux_loss_coeff", "actor_config"),
    KeyRow(MEGATRON, "noop_layers", TRANSLATED, "identity layers padding num_layers to a "
           "multiple of the pipeline size: the real layers of each stage become "
           "actor_config.num_layer_list (first/last stages shorter)"),
    KeyRow(MEGATRON, "num_layers", TRANSLATED, "with noop_layers: the padded layer count "
           "(model layers + noop layers); without: must equal the model's layers"),
    KeyRow(MEGATRON, "moe_tp_extend_ep", TRANSLATED, "true: experts are not split by TP but "
           "spread over TP x EP ranks = actor_config.expert_tensor_parallel_size 1 and "
           "expert_model_parallel_size x tensor_model_parallel_size"),
    *_na(MEGATRON, "use_flash_attn use_fused_rmsnorm use_fused_swiglu use_fused_rotary_pos_emb "
         "no_masked_softmax_fusion attention_softmax_in_fp32 no_gradient_accumulation_fusion "
         "gemm_gradient_accumulation_fusion no_bias_dropout_fusion "
         "moe_grouped_gemm moe_permutation_async_comm "
         "use_fused_moe_token_permute_and_unpermute moe_token_dispatcher_type use_ascend_coc "
         "coc_mode coc_parallel_num coc_fused_kernel use_fused_ring_attention_update "
         "use_cp_send_recv_overlap npu_deterministic transformer_impl spec", _KERNEL),
    *_na(MEGATRON, "shape_order", "NPU only: the tensor layout (SBH, BSH, BSND, BNSD) MindSpeed "
         "hands to the NPU fused attention kernel; attention here computes the same function "
         "in its own layout"),
    *_na(MEGATRON, "moe_alltoall_overlap_comm", "NPU only: MindSpeed overlaps the MoE token "
         "all-to-all with expert computation; the same tokens reach the same experts "
         "(megatron-core's all-to-all dispatcher here, without the overlap)"),
    *_na(MEGATRON, "swap_optimizer", "NPU only: MindSpeed swaps optimizer state between "
         "device and host during the step to save device memory; the step computes the same "
         "update (here generate_config.offload_train_optimizer moves it to the host around "
         "generation)"),
    *_na(MEGATRON, "reuse_fp32_param swap_attention recompute_activation_function "
         "overlap_grad_reduce overlap_param_gather ddp_bucket_size "
         "accumulate_allreduce_grads_in_fp32 use_tp_pp_dp_mapping", _MEMORY),
    *_na(MEGATRON, "no_shared_storage", "checkpoint storage across nodes: every rank writes "
         "its own shards into actor_config.save (a shared file system is assumed)"),
    *_na(MEGATRON, "reset_attention_mask no_pad_to_seq_lengths variable_seq_lengths "
         "pad_to_multiple_of reset_position_ids", _PACKING),
    *_na(MEGATRON, "use_mcore_models", "megatron-core models are the only ones here",
         _one_of(True), "true"),
    KeyRow(MEGATRON, "stage", TRANSLATED, "the algorithm is the launcher's: ray_grpo and "
           "ray_dapo run under pretrain_grpo.py, ray_ppo under pretrain_ppo.py, dpo under "
           "pretrain_dpo.py"),
    *_na(MEGATRON, "tokenizer_type", "tokenizers are Hugging Face tokenizers",
         _one_of("PretrainedFromHF", "HuggingFaceTokenizer", None), "PretrainedFromHF"),
    *_na(MEGATRON, "distributed_backend", "the platform picks it (hccl / nccl / gloo)"),
    *_na(MEGATRON, "split", "the whole data_path is the training set (evaluation reads "
         "megatron_training.test_data_path)", _one_of("100,0,0", None), "100,0,0"),
    *_same(MEGATRON, "no_shuffle", "megatron_training"),
    *_na(MEGATRON, "full_shuffle_instruction_dataset", "prompts are shuffled per epoch with "
         "megatron_training.seed here (or read in file order with no_shuffle); another order "
         "changes the run", _off, "false"),
    *_na(MEGATRON, "dataset_additional_keys", "the answers of a MindSpeed-RL packed dataset are "
         "read from its labels field; other fields are not used"),
    *_na(MEGATRON, "is_instruction_dataset skip_train do_sample use_kv_cache "
         "load_checkpoint_loosely", "not used by GRPO here", _off, "false"),
    *_same(MEGATRON, "is_pairwise_dataset dpo_loss_type dpo_beta dpo_label_smoothing pref_ftx "
           "refer_model_iter", "megatron_training"),
    KeyRow(MEGATRON, "ref_model", TRANSLATED, "-> ref_config.load: the reference's "
           "checkpoint (null: the weights the actor starts from)"),
    *_na(MEGATRON, "attention_dropout hidden_dropout", "the policy trains without dropout here",
         _one_of(0.0, None), "0.0"),
    *_na(MEGATRON, "init_method_std", "weights are loaded, never initialised for training"),
    *_na(MEGATRON, "initial_loss_scale", "the first dynamic loss scale of fp16 training; "
         "training here is bf16 or fp32, which Megatron runs without loss scaling"),
    *_na(MEGATRON, "optimizer", "the optimizer is Adam(W)", _one_of("adam", None), "adam"),
    *_na(MEGATRON, "no_save_optim no_save_rng", "checkpoints always hold the optimizer and RNG "
         "state here (a resumed run repeats the uninterrupted one)"),
    *_same(MEGATRON, "context_parallel_size context_parallel_algo attention_mask_type",
           "actor_config"),
    *_na(MEGATRON, "num_layers_per_virtual_pipeline_stage", "virtual pipeline stages are not "
         "implemented here", _off, "null"),
    *_na(MEGATRON, "ai_framework", "PyTorch only", _off, "null"),
    *_na(MEGATRON, "mm_model pretrained_checkpoint", "multimodal models and "
         "pretrained_checkpoint are not implemented here", _off, "null"),
    *_same(MEGATRON, "lora_target_modules lora_r lora_alpha lora_fusion lora_ckpt_filter",
           "actor_config"),
    KeyRow(MEGATRON, "lora_filter", TRANSLATED, "-> actor_config.lora_ckpt_filter (the name "
           "MindSpeed-RL's LoRA guide uses)"),
    *_na(MEGATRON, "log_interval log_throughput eval_interval eval_iters "
         "enable_high_availability num_workers dataloader_type", _LOGGING),
    *_same(MEGATRON, "prompt_type", "megatron_training"),
    *_na(MEGATRON, "prompt_type_path tokenizer_not_use_fast tokenizer_padding_side "
         "vocab_extra_ids make_vocab_size_divisible_by", _DATA_PREP + "; the vocabulary is "
         "padded to a multiple of 128 internally and the pad columns are masked"),
    *_na(MEGATRON, "algorithm", "the launcher decides the algorithm"),
    *_na(MEGATRON, "use_rotary_position_embeddings", "every architecture built here uses "
         "rotary position embeddings (from the model's config)"),
    *_na(MEGATRON, "moe_router_load_balancing_type", "with moe_aux_loss_coeff 0 no balancing "
         "loss is added; aux_loss is megatron-core's own", _one_of("aux_loss", "none", None),
         "aux_loss or none"),
    # architecture keys: the model yaml holds them
    *_na(MEGATRON, "hidden_size ffn_hidden_size num_attention_heads kv_channels "
         "group_query_attention num_query_groups untie_embeddings_and_output_weights "
         "max_position_embeddings rotary_base norm_epsilon add_qkv_bias qk_layernorm "
         "num_experts moe_ffn_hidden_size moe_router_topk padded_vocab_size "
         "position_embedding_type normalization swiglu disable_bias_linear attention_bias "
         "norm_topk_prob multi_latent_attention "
         "n_shared_experts first_k_dense_replace moe_layer_freq seq_aux "
         "moe_router_num_groups moe_router_group_topk moe_router_topk_scaling_factor "
         "moe_router_score_function moe_router_enable_expert_bias qk_pos_emb_head_dim "
         "qk_head_dim q_lora_rank kv_lora_rank v_head_dim rope_scaling_type rope_scaling_factor "
         "low_freq_factor high_freq_factor original_max_position_embeddings beta_fast "
         "beta_slow rope_scaling_mscale rope_scaling_mscale_all_dim "
         "rope_scaling_original_max_position_embeddings", _MODEL_YAML, _off,
         "absent here (the model yaml or the HF config.json holds the architecture)"),

    # ---- rl_config ----------------------------------------------------------------------
    *_same(RL, "n_samples_per_prompt mini_batch_size epochs clip_ratio kl_penalty init_kl_coef "
           "entropy_coeff max_prompt_length adv_estimator verifier_function verifier_weight "
           "actor_forward_micro_batch_size ref_forward_micro_batch_size use_tensorboard "
           "use_wandb wandb_project gamma lam cliprange_value advantage_whiten use_kl_in_reward "
           "kl_ctrl_type kl_horizon kl_target filter_groups_enable filter_groups_metric",
           "rl_config"),
    KeyRow(RL, "rule_reward", TRANSLATED, "true: the rule verifiers of verifier_function "
           "score the responses (with reward_config's reward model when there is one); false: "
           "no rule verifiers (verifier_function is not read), the reward model alone"),
    KeyRow(RL, "use_integrated_worker", TRANSLATED, "true (the integrated worker): every role "
           "on every rank, as here; false or absent next to actor_resource: MindSpeed-RL's "
           "separate-worker format, whose reference and reward model have NPUs and layouts of "
           "their own (ref_config, reward_config with reference_resource, reward_resource); "
           "here they run co-located on the actor's ranks, in the actor's layout"),
    *_na(RL, "guarantee_order blocking num_cpus_for_local_task num_cpus_for_placement_group "
         "hccl_buffersize runtime_env_path zmq_communication data_strategy "
         "transfer_queue_data_shard_num transfer_queue_data_shard_port_base actor_resource "
         "integrated_mode_config", _RAY),
    *_na(RL, "actor_rollout_dispatch_size actor_logprob_dispatch_size ref_dispatch_size "
         "reward_dispatch_size adv_dispatch_size actor_update_dispatch_size "
         "dynamic_sampling_dispatch_size kl_dispatch_size", _DISPATCH),
    *_same(RL, "use_remove_padding use_dynamic_bsz max_packing_token_size "
           "ref_max_packing_token_size actor_max_packing_token_size "
           "update_max_packing_token_size dynamic_max_batch_size ref_dynamic_max_batch_size "
           "actor_dynamic_max_batch_size update_dynamic_max_batch_size", "rl_config"),
    *_na(RL, "use_dp_batch_balance", "the TransferDock balances every get by tokens over the "
         "data-parallel ranks here"),
    *_na(RL, "verifier_parallel verifier_timeout", "rule rewards are scored in-process on the "
         "rank that generated the responses"),
    *_na(RL, "log_max_throughput wandb_exp_name wandb_save_dir use_swanlab swanlab_mode "
         "swanlab_project swanlab_exp_name swanlab_save_dir", _LOGGING),
    KeyRow(RL, "token_level_loss", TRANSLATED, "-> rl_config.loss_agg_mode (true: "
           "token-mean, false: seq-mean-token-mean)"),
    *_na(RL, "shuffle_mini_batch", "mini-batches are taken in rollout order here", _off,
         "false"),
    *_na(RL, "beta num_samples_per_step", "not read by MindSpeed-RL's GRPO, PPO or DAPO "
         "trainers either"),
    *_na(RL, "reference_resource reward_resource critic_resource", _RAY),
    *_na(RL, "vit_resource", _RAY + "; a ViT is not implemented here", _off, "null"),
    KeyRow(RL, "clip_higher_enable", TRANSLATED, "true: rl_config.clip_ratio_low / "
           "clip_ratio_high apply; false: they are dropped (clip_ratio on both sides)"),
    *_same(RL, "clip_ratio_low clip_ratio_high", "rl_config"),
    KeyRow(RL, "overlong_buffer_enable", TRANSLATED, "with overlong_buffer -> "
           "rl_config.overlong_buffer_len (0 when false)"),
    KeyRow(RL, "overlong_buffer", TRANSLATED, "-> rl_config.overlong_buffer_len (when "
           "overlong_buffer_enable)"),
    KeyRow(RL, "overlong_buffer_penalty_factor", TRANSLATED,
           "-> rl_config.overlong_penalty_factor"),
    KeyRow(RL, "rollout_max_tokens", TRANSLATED, "must equal generate_config.sampling_config."
           "max_tokens (the overlong penalty ends there)"),
    KeyRow(RL, "filter_groups_max_batches", TRANSLATED, "-> rl_config.max_num_gen_batches "
           "(-1 -> 0, no limit)"),
    KeyRow(RL, "filter_groups_train_batch_size", TRANSLATED, "the informative groups an "
           "iteration trains on -> megatron_training.global_batch_size, and their "
           "global_batch_size (prompts per generation round) -> rl_config.gen_batch_size"),
    *_same(RL, "partial_rollout_max_split require_max_age_all_finished async_engine",
           "rl_config"),
    *_na(RL, "is_multimodal reuse_image_embeds colocate_actor_and_vit "
         "tp_split_expert", "multimodal models and expert splitting in "
         "resharding are not implemented here", _off, "false"),
    *_same(RL, "multi_turn_enable tool_config_path max_tool_calls max_parallel_calls "
           "max_total_response_length max_tool_response_length tool_response_truncate_side "
           "tool_parser_format", "rl_config"),
    *_same(RL, "share_backbone", "rl_config"),
    *_na(RL, "vit_forward_micro_batch_size actor_image_embeds_dispatch_size",
         "multimodal settings (switched off)"),

    # ---- generate_config ------------------------------------------------------------------
    *_same(GENERATE, "infer_tensor_parallel_size infer_expert_parallel_size max_num_seqs "
           "max_model_len max_num_batched_tokens dtype gpu_memory_utilization enforce_eager "
           "offload_train_optimizer offload_train_grad offload_train_param "
           "enable_prefix_caching enable_expert_parallel expert_map_path", "generate_config"),
    *_na(GENERATE, "infer_pipeline_parallel_size", "vLLM runs without pipeline parallelism "
         "(MindSpeed-RL does not support it either)", _at_most_one, "1"),
    *_na(GENERATE, "trust_remote_code", "the supported architectures are built into vLLM and "
         "transformers: no remote code is run"),
    *_na(GENERATE, "num_scheduler_steps", "vLLM V1 schedules one step at a time"),
    *_na(GENERATE, "torchair_graph", "NPU only: vllm-ascend's torchair graph mode (the decode "
         "step compiled as a graph); it does not change what is sampled; enforce_eager is "
         "honoured"),
    *_na(GENERATE, "ascend_scheduler_config_enabled", "NPU only: vllm-ascend's scheduler "
         "choice; enforce_eager is honoured"),
    *_na(GENERATE, "data_parallel_size", "derived here: world size / "
         "infer_tensor_parallel_size"),
    *_na(GENERATE, "tokenizer_name_or_path", "vLLM uses megatron_training.tokenizer_name_or_path "
         "and the model's config.json"),
    *_na(GENERATE, "limit_mm_image_per_prompt limit_mm_video_per_prompt",
         "multimodal settings (switched off)"),
    *_na(GENERATE, "eplb_token_collects eplb_token_save_path", "EPLB statistics (NPU only): "
         "MindSpeed-RL's own patch of vllm-ascend's MoE layer writes each expert's token "
         "counts to eplb_token_save_path, the input of its expert-map generator; vLLM does not "
         "collect them, so no files are written here (an expert map made elsewhere is read "
         "from generate_config.expert_map_path)"),

    # ---- generate_config.sampling_config ----------------------------------------------------
    *_same(SAMPLING, "temperature top_p top_k min_p max_tokens seed logprobs",
           "generate_config.sampling_config"),
    *_na(SAMPLING, "detokenize", "responses are decoded for the verifiers in any case"),

    # ---- keys of older MindSpeed-RL versions ------------------------------------------------
    *_old(RL, "colocate_actor_ref colocate_all_models", _MARCH_2025, NOT_APPLICABLE,
          "whether MindSpeed-RL put roles on the same NPUs; here every role is co-located on "
          "every rank. It also dates the file: rl_config.mini_batch_size counted responses "
          "then, and is read so"),
    *_old(RL, "experience_count experience_count_actor experience_count_ref "
          "experience_count_reward experience_count_rule_reward", _EXPERIENCE_COUNT,
          TRANSLATED, "prompts per TransferDock fetch (today's *_dispatch_size, not "
          "applicable here: each get takes a data-parallel rank's whole share); it also dates "
          "the file: rl_config.mini_batch_size counted responses then, and is read so"),
    *_old(GENERATE, "micro_batch_size", _GEN_MBS, TRANSLATED,
          "prompts per rollout fetch from the TransferDock (today's actor_rollout_dispatch_size, "
          "not applicable here); it also dates the file: rl_config.mini_batch_size counted "
          "responses then, and is read so"),
    *_old(RL, "update_micro_batch_size", _UPDATE_MBS, TRANSLATED,
          "the integrated worker's update micro-batch (responses) -> "
          "actor_config.micro_batch_size; actor_config.micro_batch_size then sized the "
          "log-prob forwards -> rl_config.actor_forward_micro_batch_size and "
          "ref_forward_micro_batch_size (unless set)"),
    *_old(RL, "shuffle_minibatch", "MindSpeed-RL master 2025-06-19 to 2025-06-20 (its "
          "March 2025 configs carried it unread)", NOT_APPLICABLE,
          "shuffle_mini_batch's name for one day: mini-batches are taken in rollout order here",
          _off, "false"),
    *_old(RL, "td_status_log", "MindSpeed-RL 2.1.0 (2025-07-14 to 2025-08-04)", NOT_APPLICABLE,
          _LOGGING),
    *_old(RL, "enable_sharding_validate", "MindSpeed-RL 2.0.0 to 2.1.0 (removed 2025-09-11)",
          NOT_APPLICABLE, "a debugging check of the resharded weights; the allgather-swap "
          "flow is tested on its own here"),
    *_old(RL, "kl_coef", _NEVER_READ, NOT_APPLICABLE,
          "not read by MindSpeed-RL either: the KL coefficient is rl_config.init_kl_coef"),
    *_old(RL, "missing_eos_penalty", _NEVER_READ, NOT_APPLICABLE,
          "not read by MindSpeed-RL either: a response without EOS is scored by the verifiers "
          "as it is"),
    *_na(RL, "critic_update_dispatch_size critic_value_dispatch_size", _DISPATCH),
    *_old(GENERATE, "chunked_prefill_for_mla", "MindSpeed-RL master 2025-09-04 to 2025-09-05",
          NOT_APPLICABLE, "NPU only: a vllm-ascend option of multi-latent attention "
          "(DeepSeek-V3) prefill; vLLM chooses its own MLA prefill here"),
    *_old(GENERATE, "infer_prefill_context_parallel_size infer_decode_context_parallel_size",
          "MindSpeed-RL master 2026-01-15 (reverted the same day)", NOT_APPLICABLE,
          "vLLM context parallelism is not used here", _at_most_one, "1"),
    *_old(MEGATRON, "cp_attention_mask_type", "MindSpeed-RL 2.2.0 (2025-06-30 to 2025-10-16)",
          NOT_APPLICABLE, "2.2.0's mask type of context parallelism; only causal attention "
          "is built here (actor_config.attention_mask_type)", _one_of("causal", None),
          "causal"),
    *_old(MEGATRON, "use_mc2", _MARCH_2025, NOT_APPLICABLE, _KERNEL),
    *_old(MEGATRON, "use_deter_comp", "MindSpeed-RL 2.0.0 to 2.2.0 (2025-03-27 to "
          "2025-10-16)", NOT_APPLICABLE, _KERNEL),
    *_old(MEGATRON, "variable_seq_length", "MindSpeed-RL 2.3.0 (2025-12-18 to 2026-03-22)",
          NOT_APPLICABLE, _PACKING),
    *_old(MEGATRON, "wandb_project wandb_exp_name wandb_save_dir", "MindSpeed-RL master "
          "2025-08-25 to 2025-08-29 (rl_config holds them)", NOT_APPLICABLE, _LOGGING),
    *_old(MEGATRON, "moe_intermediate_size", "MindSpeed-RL 2.0.0 to 2.2.0 (2025-03-26 to "
          "2025-10-16)", NOT_APPLICABLE, "the experts' hidden size under its older name "
          "(moe_ffn_hidden_size): " + _MODEL_YAML, _off,
          "absent here (the model yaml or the HF config.json holds the architecture)"),
    *_old(MEGATRON, "multi_head_latent_attention n_group qk_nope_head_dim "
          "qk_rope_head_dim rope_scaling_beta_fast rope_scaling_beta_slow routed_scaling_factor "
          "topk_group", "MindSpeed-RL 2.0.0 to 2.2.0 (2025-03-26 to 2025-10-16)",
          NOT_APPLICABLE, "a DeepSeek-V3 architecture key (multi-latent attention, grouped "
          "routing) of that version's model yamls: " + _MODEL_YAML, _off,
          "absent here (the model yaml or the HF config.json holds the architecture)"),
    *_na(MEGATRON, "no_check_for_nan_in_loss_and_grad", "Megatron's NaN check of the loss "
         "and gradients; here a non-finite loss or gradient always skips the step "
         "(rl_config.max_consecutive_skipped_steps)"),
]

_BY_KEY = {(r.family, r.name): r for r in ROWS}


def row(family: str, name: str) -> KeyRow | None:
    """The table row of ``name`` read in ``family``, or None when MindSpeed-RL has no such key."""
    return _BY_KEY.get((family, name))


def known_names(family: str) -> list[str]:
    return [r.name for r in ROWS if r.family == family]


def family_of(section: str) -> str | None:
    for family, sections in FAMILY_SECTIONS.items():
        if section in sections:
            return family
    return None


def typo_hint(name: str, candidates, prefix: str = "") -> str | None:
    """``did you mean X?`` only for a near-identical spelling.

    difflib's usual cutoff (0.6) offers unrelated keys that share words
    (actor_update_dispatch_size -> actor_forward_micro_batch_size); a hint must point at
    a key meaning the same thing, so only a close misspelling qualifies.
    """
    matches = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.85)
    return f"did you mean {prefix}{matches[0]}?" if matches else None


def _older(r: KeyRow) -> str:
    if not r.history:
        return ""
    if r.history.startswith("MindSpeed-RL"):
        return f" (an older MindSpeed-RL key: {r.history})"
    return f" ({r.history})"


def underscored(body: dict, prefix: str, problems: list,
                notices: list | None = None) -> tuple[dict, dict[str, str]]:
    """``body`` with each key's '-' read as '_', as MindSpeed-RL reads its sections
    (``UNDERSCORED_SECTIONS``), and ``{key: key as written}`` of the renamed keys; a line
    for each goes to ``notices``. Both spellings of one key with different values are a
    problem naming both."""
    out: dict = {}
    spelled: dict[str, str] = {}
    for written, value in body.items():
        key = written.replace("-", "_") if isinstance(written, str) else written
        if key in out:   # both spellings
            if out[key] != value:
                first = spelled.get(key, key)
                problems.append(ConfigError(f"{prefix}.{written}", f"{prefix}.{first}="
                                            f"{show_value(out[key])} is the same key "
                                            "(MindSpeed-RL reads '-' in a key as '_') with "
                                            "another value", "keep one of them", value=value))
            continue
        if key != written:
            spelled[key] = written
            if notices is not None:
                notices.append(f"{prefix}.{written}={show_value(value)}: read as {prefix}."
                               f"{key} (MindSpeed-RL reads '-' in a key as '_', as Megatron's "
                               "argument parser does)")
        out[key] = value
    return out, spelled


def not_applicable_error(dotted: str, value: Any, r: KeyRow) -> ConfigError:
    return ConfigError(dotted, f"cannot be honoured here{_older(r)}: {r.detail}",
                       f"accepted: {r.needs}; or remove the key", value=value)


def notice_line(dotted: str, value: Any, r: KeyRow) -> str:
    return f"{dotted}={show_value(value)}{_older(r)}: {r.detail}"
