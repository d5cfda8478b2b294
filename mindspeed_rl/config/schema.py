"""The job configuration: one frozen dataclass per YAML section.

Section and key names follow MindSpeed-RL (``megatron_training``,
``actor_config``, ``rl_config``, ``generate_config.sampling_config``) and
Megatron's argument names, so existing configs need few edits. Every key
carries its documentation in ``metadata["doc"]`` (shown by errors and in the
docs); keys marked ``path`` are resolved against the current working directory
when loading, as Megatron does with its command-line paths.

Defaults describe a small CPU run (tiny model, one or two ranks, fp32); the
real-size configs in ``configs/`` set everything that matters for a cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from mindspeed_rl.config.model_spec import ModelSpec


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, path: bool = False) -> Any:
    """A config key: its default (MISSING = required) and its one-line documentation."""
    metadata = {"doc": doc, "path": path}
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class MegatronTrainingConfig:
    """``megatron_training``: the model, the data and the run (Megatron's global arguments)."""

    model: str = setting(doc=(
        "HF model directory (config.json + tokenizer files), or a configs/model/<name>.yaml with "
        "the HF architecture fields, or a bare <name> found as model/<name>.yaml next to this "
        "config file"), path=True)
    tokenizer_name_or_path: str | None = setting(None, (
        "tokenizer directory or hub id; default: the model's HF directory, or the "
        "tokenizer_name_or_path of the model yaml"))
    global_batch_size: int = setting(4, "prompts per iteration, over all ranks (each gets "
                                        "rl_config.n_samples_per_prompt responses)")
    seq_length: int = setting(512, (
        "Megatron's sequence length of the prompt data, as MindSpeed-RL uses it: prompts are "
        "read at most this long (prompts longer than rl_config.max_prompt_length are dropped; "
        "when seq_length is shorter, longer kept prompts are cut to their first seq_length "
        "tokens, with a warning); must be <= generate_config.max_model_len"))
    train_iters: int = setting(10, "RL iterations to run (each: rollout, rewards, advantages, "
                                   "the forwards and the updates; any algorithm)")
    save_interval: int = setting(0, "iterations between checkpoints to actor_config.save; "
                                    "0 = only after the last iteration")
    exit_duration_in_mins: float | None = setting(None, (
        "stop after the first iteration that ends this many minutes after training started "
        "(Megatron's key): evaluate and checkpoint as after the last iteration; null = run "
        "all train_iters"))
    seed: int = setting(1234, "seed of data order, initialisation and dropout")
    data_path: str = setting(doc=(
        "training prompts: a .jsonl/.json/.parquet file, a directory of them, or the prefix of a "
        "MindSpeed-RL packed indexed dataset (P for P_packed_input_ids_document.{bin,idx}; "
        "docs/algorithms.md)"), path=True)
    test_data_path: str | None = setting(None, "evaluation prompts (same format); null = no "
                                               "evaluation", path=True)
    no_shuffle: bool = setting(False, "read the training prompts in file order instead of a "
                                      "seeded shuffle per epoch")
    prompt_key: str = setting("prompt", "dataset column holding the prompt")
    prompt_type: str | None = setting(None, (
        "MindSpeed-RL's prompt template name. qwen_retool: the tokenizer's chat template with "
        "the tools of rl_config.tool_config_path described in the system message (hermes) "
        "and the boxed-answer instruction after the question (multi-turn needs it); any other "
        "name or null: the tokenizer's own chat template"))
    answer_key: str = setting("answer", "dataset column holding the reference answer for the "
                                        "verifiers")
    bf16: bool = setting(False, "train in bfloat16 with fp32 master weights; false = fp32 "
                                "throughout")
    use_distributed_optimizer: bool = setting(False, "shard the fp32 master weights and Adam "
                                                     "moments over the training data-parallel "
                                                     "ranks")
    sequence_parallel: bool = setting(False, "Megatron sequence parallelism (needs "
                                             "actor_config.tensor_model_parallel_size > 1)")
    log_dir: str = setting("./logs", "where metrics.jsonl (always) and tensorboard events go",
                           path=True)
    test_interval: int = setting(0, "iterations between evaluations on test_data_path; 0 = never")
    num_test_prompts: int | None = setting(None, "prompts per evaluation; null = the whole test "
                                                 "set")
    # DPO (pretrain_dpo.py; MindSpeed-LLM's names and defaults, as MindSpeed-RL's DPO
    # configs give them in this section)
    is_pairwise_dataset: bool = setting(False, (
        "data_path holds preference pairs (prompt, chosen, rejected): DPO's data, trained "
        "by pretrain_dpo.py (which needs it true)"))
    dpo_loss_type: Literal["sigmoid", "hinge", "ipo"] = setting("sigmoid", (
        "DPO's loss per pair: sigmoid (DPO, with dpo_label_smoothing: cDPO), hinge (SLiC), "
        "ipo (IPO, on length-averaged log-probs)"))
    dpo_beta: float = setting(0.1, "DPO's beta: the implicit reward's scale (IPO: its tau)")
    dpo_label_smoothing: float = setting(0.0, (
        "cDPO: the probability that a pair's preference label is flipped, in [0, 0.5); "
        "sigmoid loss only"))
    pref_ftx: float = setting(0.0, (
        "DPO: coefficient of an SFT term added to the loss (the chosen response's mean "
        "negative log-prob)"))
    refer_model_iter: int = setting(1, (
        "MindSpeed-LLM: the iteration of ref_model's checkpoint a resumed DPO run reloads the "
        "reference from; here every checkpoint records the reference's weights' source and a "
        "resumed run reloads exactly those, so only 1 (the initial weights) is accepted"))


@dataclass(frozen=True, kw_only=True)
class OptimizerKeys:
    """The optimizer and LR-schedule keys a trainable role's section carries (Adam, Megatron
    names); ``mindspeed_rl.engine.optim.TrainableModel`` reads them straight from the section."""

    lr: float = setting(1e-6, "peak learning rate")
    min_lr: float = setting(0.0, "learning rate at the end of linear/cosine decay")
    lr_decay_style: Literal["constant", "linear", "cosine"] = setting(
        "constant", "learning-rate schedule after warmup")
    lr_warmup_fraction: float = setting(0.0, "fraction of the optimizer steps spent warming up")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    clip_grad: float = setting(1.0, "gradient-norm clipping threshold; 0 = no clipping")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.95, "Adam beta2")


@dataclass(frozen=True, kw_only=True)
class ActorConfig(OptimizerKeys):
    """``actor_config``: the policy's training layout, optimizer and checkpoints."""

    micro_batch_size: int = setting(1, "responses per forward/backward micro-batch on one "
                                       "training data-parallel rank")
    tensor_model_parallel_size: int = setting(1, "training tensor parallelism (TP)")
    pipeline_model_parallel_size: int = setting(1, "training pipeline parallelism (PP)")
    expert_model_parallel_size: int = setting(1, "expert parallelism for MoE models (EP); 1 for "
                                                 "dense models")
    context_parallel_size: int = setting(1, (
        "context parallelism (CP): each packed row is split over this many ranks along the "
        "sequence, so one long row's activations and attention are shared out; the training "
        "data-parallel size becomes world / (TP x CP x PP) (docs/long_context.md)"))
    context_parallel_algo: Literal["megatron_cp_algo", "ulysses_cp_algo"] = setting(
        "ulysses_cp_algo", (
            "with context_parallel_size > 1: megatron_cp_algo = ring attention (each rank "
            "holds two of 2 x CP load-balanced chunks of every row, K/V pass around the ring); "
            "ulysses_cp_algo = all-to-all between sequence and head sharding (query and KV "
            "heads must divide by TP x CP). MindSpeed-RL's default is ulysses_cp_algo"))
    attention_mask_type: str = setting("causal", (
        "the attention mask under context parallelism; only causal (each packed row attends "
        "to its own earlier tokens) is built; general (MindSpeed's mask given with the data) "
        "is accepted without context parallelism, where it changes nothing"))
    load: str | None = setting(None, "Megatron checkpoint directory to start from "
                                     "(tools/convert_ckpt.py output or an earlier save); null = "
                                     "the HF weights of megatron_training.model", path=True)
    save: str | None = setting(None, "checkpoint directory to write (the whole trainer: actor, "
                                     "critic, data position); null = no checkpoints", path=True)
    no_load_optim: bool = setting(False, "do not restore optimizer state from load")
    trust_checkpoint: bool = setting(False, "read the pickled parts (.metadata, common.pt) of "
                                            "load's and ref_config.load's torch_dist checkpoints "
                                            "with plain pickle, which runs any code they name; "
                                            "only for a trusted checkpoint the allow-list refuses "
                                            "(docs/models.md)")
    no_load_rng: bool = setting(False, "do not restore RNG state from load")
    finetune: bool = setting(False, "start from load's weights at iteration 0, without its "
                                    "optimizer, RNG and data state (Megatron's --finetune)")
    moe_aux_loss_coeff: float = setting(0.0, "MoE load-balancing (aux) loss coefficient added "
                                             "to the policy loss; 0 = none")
    expert_tensor_parallel_size: int | None = setting(
        None, "tensor parallelism inside the experts of a MoE model (megatron-core's "
              "expert_tensor_parallel_size); null = tensor_model_parallel_size")
    recompute_granularity: Literal["full", "selective"] | None = setting(
        None, "activation recompute (megatron-core): full = whole layers, selective = core "
              "attention only; null = off")
    recompute_method: Literal["uniform", "block"] | None = setting(
        None, "with recompute_granularity full: uniform = every recompute_num_layers layers "
              "form a recomputed unit, block = the first recompute_num_layers layers of each "
              "pipeline stage are recomputed")
    recompute_num_layers: int | None = setting(
        None, "layers per recompute unit (uniform) or recomputed layers per stage (block)")
    num_layer_list: str | None = setting(
        None, "transformer layers of each pipeline stage, comma-separated (e.g. '16,17,16,15'; "
              "MindSpeed-LLM's name); null = num_layers / pipeline_model_parallel_size each")
    lora_target_modules: tuple[str, ...] = setting((), (
        "LoRA: the megatron linears that get low-rank adapters, any of linear_qkv, "
        "linear_proj, linear_fc1, linear_fc2 (MindSpeed-RL's names); the rest of the model is "
        "frozen and only the adapters train. Empty = full fine-tuning (docs/lora.md)"))
    lora_r: int = setting(8, "LoRA rank r of every adapter (used with lora_target_modules)")
    lora_alpha: float = setting(16, "LoRA alpha: an adapter adds (lora_alpha / lora_r) * B A "
                                    "to its weight")
    lora_fusion: bool = setting(False, (
        "accepted for MindSpeed-RL configs: on Ascend it selects CCLoRA, which overlaps the "
        "adapter matmuls with the TP communication; the result is the same, and here the "
        "adapters always run as separate matmuls (docs/lora.md)"))
    lora_ckpt_filter: bool = setting(False, (
        "with LoRA: checkpoints in actor_config.save hold only the adapters (and their "
        "optimizer state), with the base model's identity recorded; a resume reads the base "
        "weights from that recorded source (MindSpeed-RL's lora_ckpt_filter / lora_filter)"))


@dataclass(frozen=True, kw_only=True)
class CriticConfig(OptimizerKeys):
    """``critic_config`` (PPO): the value model, trained beside the actor in the same layout."""

    load: str | None = setting(None, (
        "initial critic weights: an HF directory (a causal LM: its body, with a new value "
        "head; a *ForSequenceClassification reward model: body and score head) or a checkpoint "
        "converted by tools/convert_ckpt.py; null = the actor's HF weights with a new value "
        "head. A resumed run restores the critic from actor_config.load instead"), path=True)
    micro_batch_size: int = setting(1, "responses per critic forward/backward micro-batch on "
                                       "one training data-parallel rank")
    tensor_model_parallel_size: int | None = setting(None, (
        "accepted for MindSpeed-RL configs: every role runs in the actor's training layout, so "
        "it must equal actor_config.tensor_model_parallel_size (null = that value)"))
    pipeline_model_parallel_size: int | None = setting(None, (
        "as tensor_model_parallel_size: must equal actor_config.pipeline_model_parallel_size"))
    value_head_init_std: float | None = setting(None, (
        "std of the normal init of a new value head; 0 starts every value at 0 (the critic "
        "then begins by predicting nothing rather than noise); null = the model's "
        "initializer_range, as transformers inits a new score head"))


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """``reward_config``: a reward model (sequence classifier) scoring each response."""

    load: str = setting(doc=(
        "the reward model: an HF *ForSequenceClassification directory, or a checkpoint "
        "tools/convert_ckpt.py made from one (it keeps the score head). One without a "
        "[1, hidden] score head, or with another vocabulary or tokenizer than the actor's, is "
        "refused from its files at start, before vLLM and the actor are built"), path=True)
    weight: float = setting(1.0, "weight of the reward model's score in the reward, next to "
                                 "rl_config.verifier_weight of the rule verifiers")
    micro_batch_size: int = setting(1, "responses per reward-model forward micro-batch on one "
                                       "training data-parallel rank")
    tensor_model_parallel_size: int | None = setting(None, (
        "accepted for MindSpeed-RL configs: must equal actor_config.tensor_model_parallel_size "
        "(null = that value)"))
    pipeline_model_parallel_size: int | None = setting(None, (
        "must equal actor_config.pipeline_model_parallel_size (null = that value)"))


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """``rl_config``: the algorithm (GRPO, PPO), rewards, sample flow and logging."""

    n_samples_per_prompt: int = setting(4, "responses generated per prompt (the GRPO group "
                                           "size)")
    mini_batch_size: int | None = setting(None, "prompts per optimizer step (as in MindSpeed-RL); "
                                                "default: megatron_training.global_batch_size")
    epochs: int = setting(1, "passes over each iteration's responses")
    clip_ratio: float = setting(0.2, "PPO clip range epsilon of the policy ratio")
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"] = setting(
        "low_var_kl", "KL estimator against the reference model: kl (= k1, log-ratio), abs "
                      "(|log-ratio|), mse (= k2, half squared log-ratio), low_var_kl (= k3, "
                      "Schulman's low-variance estimator, clamped to [-10, 10])")
    init_kl_coef: float = setting(0.001, "KL loss coefficient; 0 = no KL term")
    entropy_coeff: float = setting(0.0, "entropy bonus coefficient")
    max_prompt_length: int = setting(256, "prompt tokens kept (longer prompts are filtered out)")
    adv_estimator: str | None = setting(
        None, "advantage estimator, among those the launcher runs (docs/algorithms.md): "
              "pretrain_grpo.py: group_norm (GRPO: reward minus group mean, over group std), "
              "rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, on_policy_distill "
              "(per-token reverse KL to teacher_config's model); pretrain_ppo.py: gae "
              "(token-level GAE on the critic's values); verl's names are accepted where they "
              "mean the same (grpo = group_norm); null = the launcher's (group_norm, gae)")
    gamma: float = setting(1.0, "discount of GAE (PPO) and of reinforce_plus_plus's returns")
    lam: float = setting(0.95, "GAE lambda (PPO)")
    advantage_whiten: bool = setting(True, "whiten GAE advantages over the whole batch (PPO)")
    cliprange_value: float = setting(0.5, "value clipping range of the critic loss (PPO)")
    critic_warmup: int = setting(0, "iterations at the start in which only the critic updates "
                                    "(PPO)")
    use_kl_in_reward: bool = setting(False, (
        "put the KL to the reference into the per-token reward (PPO; reinforce_plus_plus; "
        "scaled by the KL controller) instead of into the loss (init_kl_coef as a loss "
        "coefficient)"))
    kl_ctrl_type: Literal["fixed", "adaptive"] = setting(
        "fixed", "KL coefficient of use_kl_in_reward: fixed at init_kl_coef, or adapted toward "
                 "kl_target (Ziegler et al. 2019)")
    kl_target: float = setting(0.1, (
        "target of the adaptive KL controller: the batch's KL per response token (each "
        "sequence's token mean, averaged over the sequences), as verl's and MindSpeed-RL's "
        "controllers read it; verl's default"))
    kl_horizon: int = setting(10000, "horizon (in samples) of the adaptive KL controller")
    verifier_function: tuple[str, ...] = setting(
        ("math_answer",), "rule rewards to apply, by name (e.g. [math_answer, "
                          "final_answer_format] or MindSpeed-RL's [math_17k_acc]); see "
                          "docs/algorithms.md for the list")
    verifier_weight: tuple[float, ...] = setting(
        (1.0,), "weight of each verifier_function in the reward, same length")
    transfer_dock_mode: Literal["distributed", "centralized"] = setting(
        "distributed", "TransferDock: per-rank warehouses (distributed) or the rank-0 replay "
                       "buffer baseline (centralized)")
    transfer_dock_timeout_s: float | None = setting(None, (
        "bound in seconds on each TransferDock collective; null = collective_timeout_s"))
    collective_timeout_s: float = setting(1800.0, (
        "seconds any collective (torch.distributed world, megatron's groups, the TransferDock, "
        "vLLM's groups) waits for a rank that does not arrive; then every other rank stops with "
        "a one-line error naming the phase. Must exceed the longest imbalance between ranks "
        "(e.g. the rollout's long tail)"))
    startup_timeout_s: float | None = setting(None, (
        "seconds a collective waits for a rank while the job starts (process groups, "
        "checkpoint load, vLLM's engine build, until the first iteration), where ranks "
        "arrive further apart than in training: rank 0 alone prints the plan and probes the "
        "save folder, loads take what the file system gives each rank; null = the larger of "
        "collective_timeout_s and 600"))
    save_on_sigterm_grace_s: float = setting(30.0, (
        "seconds the job has between SIGTERM and SIGKILL to save (torchrun's "
        "--shutdown-timeout, 30 by default); the dry run and rank 0 at start estimate the "
        "save at this size and warn when it takes longer (docs/reliability.md)"))
    reward_workers: int | None = setting(None, (
        "processes that run the rule verifiers (model output is untrusted input: a call that "
        "hangs is killed there); null = this rank's share of the node's CPU cores, at most 8; "
        "0 = in the training process, without time limits"))
    reward_timeout_s: float = setting(10.0, (
        "seconds one verifier call on one response may take in a reward worker; then the "
        "worker is killed and replaced, the call scores reward_failed_score and counts in "
        "reward/timeouts"))
    reward_batch_timeout_s: float | None = setting(None, (
        "seconds the rewards of one rank's batch may take; calls unfinished then score "
        "reward_failed_score and count in reward/timeouts; null = half of "
        "collective_timeout_s; must be below collective_timeout_s"))
    reward_failed_score: float | None = setting(None, (
        "score of a verifier call that timed out or raised (reward/errors); null = the "
        "verifier's lowest score (0 for most, -1 for acc_for_dapo, retool_reward and acc, "
        "-0.5 for strict_format), so output that breaks a verifier never beats a wrong answer"))
    max_consecutive_skipped_steps: int = setting(3, (
        "optimizer steps skipped in a row for NaN/Inf in the loss or the gradients before the "
        "run stops (each skip leaves the weights unchanged and counts in actor/skipped_steps)"))
    actor_forward_micro_batch_size: int = setting(1, "responses per micro-batch when computing "
                                                     "old log-probs")
    ref_forward_micro_batch_size: int = setting(1, "responses per micro-batch when computing "
                                                   "reference log-probs")
    critic_forward_micro_batch_size: int = setting(1, "responses per micro-batch when "
                                                      "computing the critic's values (PPO)")
    clip_ratio_low: float | None = setting(None, "lower clip epsilon of the policy ratio (1 - "
                                                 "eps_low for negative advantages); null = "
                                                 "clip_ratio")
    clip_ratio_high: float | None = setting(None, (
        "upper clip epsilon (1 + eps_high for positive advantages; DAPO's clip-higher: e.g. "
        "0.28 with clip_ratio_low 0.2); null = clip_ratio"))
    clip_ratio_c: float | None = setting(None, "dual-clip bound c > 1: the loss of a token with "
                                               "a negative advantage is at most -A * c; null = "
                                               "off")
    policy_loss: Literal["vanilla", "gspo"] = setting(
        "vanilla", "vanilla = PPO's per-token ratio; gspo = GSPO's sequence-level ratio (its "
                   "clip range goes in clip_ratio_low/high, e.g. 3e-4 / 4e-4; recommended for "
                   "MoE models)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] | None = setting(
        None, "how per-token losses become the loss, over the whole mini-batch: "
              "token-mean (DAPO), seq-mean-token-mean (original GRPO), "
              "seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: token sums over "
              "max_tokens); null = the policy loss's own: token-mean for vanilla, "
              "seq-mean-token-mean for gspo (GSPO's definition)")
    norm_adv_by_std_in_grpo: bool = setting(True, "divide GRPO advantages by the group's std; "
                                                  "false = Dr. GRPO's mean-centred rewards")
    rollout_is_threshold: float | None = setting(None, (
        "truncated importance-sampling correction of the rollout engine's samples: each "
        "token's loss x min(p_old / p_rollout, threshold), for rollouts in another dtype than "
        "training; null = off"))
    # Rollout correction (verl's keys; docs/algorithms.md "Rollout correction").
    rollout_is: Literal["token", "sequence"] | None = setting(None, (
        "verl's rollout correction: importance weights of the rollout engine's samples, "
        "training over rollout probability, per token (token) or one per sequence, the "
        "product of its tokens' ratios (sequence), truncated at rollout_is_threshold (2.0 "
        "when null) and applied to every token's loss, on-policy ones too; null = off "
        "(rollout_is_threshold alone keeps its token meaning)"))
    rollout_is_threshold_lower: float | None = setting(None, (
        "with rollout_is: lower truncation of the IS weights (weights below it are raised to "
        "it); must be below rollout_is_threshold; null = none (verl's)"))
    rollout_is_batch_normalize: bool = setting(False, (
        "with rollout_is: divide the truncated IS weights by their mean over the mini-batch "
        "of the optimizer step (all DP ranks; over tokens for token, over sequences for "
        "sequence) so they average 1"))
    rollout_rs: Literal["token", "sequence", "geometric"] | None = setting(None, (
        "verl's rejection sampling: drop from the loss each token (token), or each whole "
        "sequence (sequence: product of its ratios; geometric: their geometric mean), whose "
        "training / rollout ratio lies outside [rollout_rs_threshold_lower, "
        "rollout_rs_threshold]; token with a two-sided band is IcePop's masking; null = off"))
    rollout_rs_threshold: float | None = setting(None, (
        "upper bound of the ratio kept by rollout_rs (e.g. 2.0; required with rollout_rs)"))
    rollout_rs_threshold_lower: float | None = setting(None, (
        "lower bound of the ratio kept by rollout_rs (e.g. 0.5); null = 1 / "
        "rollout_rs_threshold"))
    rollout_token_veto_threshold: float | None = setting(None, (
        "verl's veto: a sequence with any token whose training / rollout ratio is below this "
        "(e.g. 1e-4) leaves the loss entirely; null = off"))
    max_weight_version_lag: int | None = setting(None, (
        "bound on staleness in weight versions (optimizer steps; AReaL's "
        "max_head_offpolicyness): a token generated by weights more than this many versions "
        "older than the ones an optimizer step trains stays out of its loss (counted in "
        "staleness/over_bound_token_fraction); at least the optimizer steps per iteration - "
        "1; null = only partial_rollout_max_split's bound in iterations"))
    router_replay: Literal["none", "R2", "R3"] = setting("none", (
        "MoE routing replay (verl's router_replay.mode values; docs/algorithms.md \"Routing "
        "replay\"): R2 records the experts the old-log-prob pass chose and replays them in "
        "every update micro-step; R3 records the experts vLLM chose during rollout and replays "
        "them in the old-log-prob, reference and update passes; the router weights are "
        "recomputed either way (the router keeps its gradient); none = every pass routes "
        "afresh"))
    partial_rollout_max_split: int = setting(1, (
        "partial rollout (MindSpeed-RL's key): N > 1 stops long responses early and continues "
        "them in later iterations, so every response is complete within N rollout passes and "
        "no trained row is older than N - 1 iterations; each pass generates at most "
        "ceil(max_tokens / N) new tokens per row (or, with async_engine, stops once enough "
        "groups are finished); 1 = off"))
    require_max_age_all_finished: bool = setting(True, (
        "partial rollout: rows that reached the age bound (N - 1 iterations) must finish in "
        "this iteration's rollout before training starts"))
    async_engine: bool = setting(False, (
        "step-wise generation (MindSpeed-RL's async engine): with partial rollout, a rollout "
        "pass stops on every generation-DP rank together once enough whole groups are "
        "finished and keeps the rest as partial rows; with multi_turn_enable, each trajectory "
        "continues as soon as its own tool calls are back instead of waiting for the turn's "
        "slowest call (with infer_tensor_parallel_size 1; the turns stay batch-wide with vLLM "
        "TP > 1); otherwise it changes nothing"))
    filter_groups_enable: bool = setting(False, (
        "DAPO dynamic sampling: drop the groups whose filter_groups_metric is equal for all "
        "their samples (no learning signal) and generate on fresh prompts until "
        "megatron_training.global_batch_size informative groups are collected"))
    filter_groups_metric: str = setting("reward", (
        "what dynamic sampling compares within a group: reward (the sequence reward) or the "
        "name of one of rl_config.verifier_function"))
    gen_batch_size: int | None = setting(None, (
        "prompts per generation round with dynamic sampling (verl's gen_batch_size; "
        "MindSpeed-RL's global_batch_size with filter_groups_train_batch_size); null = "
        "megatron_training.global_batch_size"))
    max_num_gen_batches: int = setting(0, "generation rounds per iteration at most with dynamic "
                                          "sampling; 0 = no limit")
    filter_groups_shortfall: Literal["error", "fill"] = setting("error", (
        "when max_num_gen_batches rounds gave too few informative groups: error (stop the run "
        "and say so) or fill (continue with uninformative groups, zero advantage, and log it)"))
    overlong_buffer_len: int = setting(0, (
        "DAPO overlong reward shaping: responses longer than max_tokens - overlong_buffer_len "
        "lose up to overlong_penalty_factor, linearly; 0 = off"))
    overlong_penalty_factor: float = setting(1.0, "the overlong penalty at max_tokens")
    log_sample_flow: bool = setting(False, (
        "write the row ids every rank received from each TransferDock get to "
        "megatron_training.log_dir/sample_flow/rank<N>.jsonl (debugging the sample flow)"))
    use_dynamic_bsz: bool = setting(False, (
        "token-budget micro-batches (MindSpeed-RL's dynamic batch size): rows are grouped by "
        "length so that each micro-batch holds at most max_packing_token_size tokens and about "
        "as many as the others, instead of a fixed number of rows padded to the longest row "
        "of the batch; the training DP ranks agree on the number of micro-batches"))
    max_packing_token_size: int = setting(4096, (
        "use_dynamic_bsz: tokens (prompt + response) per micro-batch; with use_remove_padding "
        "the length of one packed sequence, without it rows x the micro-batch's longest row. "
        "As in MindSpeed-RL it is the default of the update_, actor_ and ref_ budgets (and the "
        "budget of the critic's values and the reward model); every budget a phase of the job "
        "uses must hold the longest row, max_prompt_length + max_tokens (at most "
        "generate_config.max_model_len; MindSpeed-RL suggests twice that), the others are not "
        "checked"))
    update_max_packing_token_size: int | None = setting(None, (
        "the token budget of the actor's (and the critic's) update micro-batches; null = "
        "max_packing_token_size"))
    actor_max_packing_token_size: int | None = setting(None, (
        "the token budget of the old log-prob forward; null = max_packing_token_size"))
    ref_max_packing_token_size: int | None = setting(None, (
        "the token budget of the reference log-prob forward; null = max_packing_token_size"))
    dynamic_max_batch_size: int | None = setting(None, (
        "use_dynamic_bsz: at most this many rows in one micro-batch; null = no cap"))
    update_dynamic_max_batch_size: int | None = setting(None, (
        "the row cap of update micro-batches; null = dynamic_max_batch_size"))
    actor_dynamic_max_batch_size: int | None = setting(None, (
        "the row cap of old log-prob micro-batches; null = dynamic_max_batch_size"))
    ref_dynamic_max_batch_size: int | None = setting(None, (
        "the row cap of reference log-prob micro-batches; null = dynamic_max_batch_size"))
    use_remove_padding: bool = setting(False, (
        "packed sequences: the rows of a micro-batch run as one sequence (each attends only "
        "to itself, positions restart per row), so no position is padding. Uses megatron "
        "PackedSeqParams (THD): the core attention (mindspeed_rl.models.attention) runs each "
        "row causally on its own, no mask over the whole packed length is built. Where the "
        "attention cannot take THD (megatron's DotProductAttention, as on NPU) the rows are "
        "laid side by side inside attention only (said at start-up). Without use_dynamic_bsz "
        "a micro-batch packs the usual micro_batch_size rows"))
    share_backbone: bool = setting(False, (
        "with LoRA (actor_config.lora_target_modules): the reference model is the actor with "
        "its adapters switched off, so no second copy of the weights is built, loaded or "
        "offloaded; needs a reference (init_kl_coef > 0)"))
    multi_turn_enable: bool = setting(False, (
        "multi-turn rollouts with tools (MindSpeed-RL's ReTool): the model generates until a "
        "tool call or its end, the calls run in the tool sandbox, their responses are appended "
        "through the chat template and generation continues; the loss covers only the "
        "model's own tokens (docs/multi_turn.md). Needs tool_config_path and "
        "megatron_training.prompt_type: qwen_retool"))
    tool_config_path: str | None = setting(None, (
        "the tool YAML (MindSpeed-RL's format: tools: [{class_name, config, tool_schema}]; "
        "configs/tools/ and docs/tools.md)"), path=True)
    max_tool_calls: int = setting(1, "tool calls one trajectory may make in all; a turn "
                                     "after the last allowed call ends the trajectory")
    max_parallel_calls: int = setting(1, "tool calls of one turn that run (the rest of the "
                                         "turn's calls are ignored)")
    max_total_response_length: int | None = setting(None, (
        "tokens of the whole multi-turn response (the model's turns + tool responses + "
        "template glue); generation stops there; null = sampling_config.max_tokens"))
    max_tool_response_length: int = setting(256, (
        "characters of one tool response kept (as MindSpeed-RL: characters, not tokens); "
        "longer ones are cut at tool_response_truncate_side"))
    tool_response_truncate_side: Literal["left", "right", "middle"] = setting("middle", (
        "which part of a long tool response is kept: left = its beginning, right = its end, "
        "middle = both ends (MindSpeed-RL's meanings)"))
    tool_parser_format: str = setting("hermes", (
        "how tool calls are found in the model's text: hermes = "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; or "
        "package.module:function, a parser of your own (text -> "
        "mindspeed_rl.agent_tools.parser.ParseResult)"))
    use_tensorboard: bool = setting(False, "also write tensorboard events to "
                                           "megatron_training.log_dir")
    use_wandb: bool = setting(False, "also log to Weights & Biases")
    wandb_project: str = setting("mindspeed_rl", "wandb project name")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """``generate_config.sampling_config``: vLLM SamplingParams of the rollouts."""

    temperature: float = setting(1.0, "sampling temperature; 0 (greedy) cannot form a GRPO "
                                      "group")
    top_p: float = setting(1.0, "nucleus sampling mass, in (0, 1]")
    top_k: int = setting(-1, "top-k sampling; -1 = off")
    min_p: float = setting(0.0, "min-p sampling, in [0, 1]")
    max_tokens: int = setting(128, "response tokens at most")
    min_tokens: int = setting(0, "response tokens at least (before stop tokens count)")
    seed: int | None = setting(None, "sampling seed; null = derived from megatron_training.seed "
                                     "and the rank")
    stop_token_ids: tuple[int, ...] = setting((), "extra token ids that end a response (EOS "
                                                  "always does)")
    logprobs: int | None = setting(None, "accepted for MindSpeed-RL compatibility and not used: "
                                         "the rollout log-prob of each sampled token is always "
                                         "recorded")

    @property
    def policy_temperature(self) -> float:
        """The temperature of the policy that sampled, which training evaluates (its
        log-probs, ratio, KL and entropy use logits / this). Greedy (0) samples the argmax
        of the raw logits, and vLLM reports a greedy request's log-probs unscaled: 1."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """``generate_config``: the vLLM rollout engine and the resharding flow."""

    infer_tensor_parallel_size: int = setting(1, "vLLM tensor parallelism (TP_g); generation DP "
                                                 "= world / TP_g")
    max_num_seqs: int = setting(64, "sequences vLLM decodes concurrently per instance")
    max_model_len: int = setting(512, (
        "vLLM context length: a longest prompt must leave room for a response; vLLM stops a "
        "response there (finish reason length), with a warning when max_prompt_length + "
        "max_tokens exceeds it (refused with partial rollout or tool turns)"))
    max_num_batched_tokens: int | None = setting(None, "tokens per vLLM scheduler step; null = "
                                                       "vLLM's default")
    block_size: int | None = setting(None, (
        "tokens per vLLM KV-cache block; null = 32 on CPU (the smallest vLLM-CPU's attention "
        "takes) and vLLM's default elsewhere. The samples of one prompt share its full "
        "blocks through the prefix cache, so the part of the prompt every sample prefills "
        "again is shorter than a block (docs/performance.md)"))
    gpu_memory_utilization: float = setting(0.2, (
        "fraction of device memory vLLM may use (weights + KV cache). On CPU (vllm-cpu): the "
        "fraction of host memory for the KV caches of all ranks on the node, split evenly "
        "(becomes VLLM_CPU_KVCACHE_SPACE in GiB, at least 1; an explicit "
        "VLLM_CPU_KVCACHE_SPACE=<GiB> wins)"))
    enforce_eager: bool = setting(True, "disable CUDA/NPU graphs (faster start, slower decode)")
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", "vLLM weight and KV-cache dtype; auto = bfloat16 when megatron_training.bf16 "
                "else float32")
    resharding_bucket_mb: int = setting(128, "MiB bound of one allgather-swap bucket when moving "
                                             "weights from training to vLLM")
    offload_train_param: bool = setting(True, "move training weights to host during generation")
    offload_train_grad: bool = setting(True, "move gradient buffers to host during generation")
    offload_train_optimizer: bool = setting(True, "move optimizer state to host during "
                                                  "generation")
    enable_prefix_caching: bool = setting(True, (
        "vLLM automatic prefix caching (prompts sharing a chat-template prefix reuse its KV "
        "blocks); turned off, with a line in the plan, for rl_config.router_replay R3 (its "
        "routes need every prompt token computed)"))
    enable_expert_parallel: bool = setting(False, (
        "vLLM expert parallelism for MoE models: each expert lives whole on one rank of "
        "infer_tensor_parallel_size x infer_expert_parallel_size ranks instead of being split "
        "by TP_g (not available on vLLM-CPU: see docs/config.md)"))
    infer_expert_parallel_size: int = setting(1, (
        "generation data-parallel replicas (of infer_tensor_parallel_size ranks each) that "
        "share one expert-parallel group, as in MindSpeed-RL; vLLM's EP size is "
        "infer_tensor_parallel_size x this; > 1 needs enable_expert_parallel"))
    expert_map_path: str | None = setting(None, (
        "expert-load balancing (EPLB, MindSpeed-RL's key): a JSON expert map placing each "
        "MoE layer's experts (and redundant copies) on vLLM's expert-parallel ranks. NPU only: "
        "passed to vllm-ascend (additional_config expert_map_path); vLLM on CUDA and CPU has "
        "no expert map, there experts keep vLLM's own placement (the plan says so once). "
        "Needs enable_expert_parallel; null = vLLM's placement"), path=True)
    sampling_config: SamplingConfig = setting(SamplingConfig, "rollout sampling parameters")


@dataclass(frozen=True, kw_only=True)
class RefConfig:
    """``ref_config``: the frozen reference model of the KL term (MindSpeed-RL's section name)."""

    load: str | None = setting(None, (
        "checkpoint the reference model is read from (a converted release checkpoint, a "
        "Megatron-LM / MindSpeed-LLM checkpoint or an HF directory); null = the weights the "
        "run started from (recorded in every checkpoint this project saves)"), path=True)
    tensor_model_parallel_size: int | None = setting(None, (
        "the reference's own TP, as MindSpeed-RL's separate-worker configs give it: the "
        "reference then runs in a layout of its own (a second set of megatron groups over "
        "the actor's ranks, data parallel over the rest); null = the actor's"))
    pipeline_model_parallel_size: int | None = setting(None, (
        "the reference's own PP, as tensor_model_parallel_size; null = the actor's"))


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """``teacher_config``: the frozen teacher of on-policy distillation
    (``rl_config.adv_estimator: on_policy_distill``; its checks: config/teacher.py)."""

    load: str = setting(doc=(
        "the teacher's weights: an HF directory (config.json, safetensors, tokenizer), a "
        "checkpoint converted by tools/convert_ckpt.py, or one this project saved; its "
        "tokenizer must be the student's. Without a config.json there the teacher has the "
        "student's architecture"), path=True)
    tensor_model_parallel_size: int | None = setting(None, (
        "the teacher's TP; it runs in the actor's training layout on the same ranks, so "
        "this must equal actor_config.tensor_model_parallel_size (null = that value)"))
    pipeline_model_parallel_size: int | None = setting(None, (
        "as tensor_model_parallel_size: must equal actor_config.pipeline_model_parallel_size"))
    task_reward_coef: float = setting(0.0, (
        "weight of the sequence's task reward (the verifiers, the reward model) added to "
        "every token's advantage next to the reverse KL; 0 = pure distillation"))


@dataclass(frozen=True, kw_only=True)
class ProfilerSettings:
    """``profiler_config.integrated``: torch's profiler around phases or whole iterations, with
    MindSpeed-RL's keys (docs/performance.md, "torch's profiler on chosen phases")."""

    profile: bool = setting(False, "record torch.profiler traces (every other key needs it)")
    mstx: bool = setting(False, (
        "MindSpeed-RL's lightweight markers: here an NVTX range around every phase of every "
        "iteration when CUDA is present (what Nsight Systems shows); nothing on CPU"))
    stage: str | tuple[str, ...] = setting("all", (
        "what is profiled: all (whole iterations), or one or a list of MindSpeed-RL's "
        "stages (actor_generate, actor_compute_log_prob, reference_compute_log_prob, "
        "critic_compute_values, actor_update, critic_update) or of this job's phase names "
        "(the dry run's 'phases:' line, e.g. resharding_to_infer)"))
    profile_save_path: str | None = setting(None, (
        "folder of the traces: <path>/<stage>/rank<r>_iter<k>.pt.trace.json; null or empty "
        "= megatron_training.log_dir/profiler_data"), path=True)
    profile_export_type: Literal["text", "db"] = setting("text", (
        "text: Chrome trace JSON (chrome://tracing, Perfetto, TensorBoard); db is torch_npu's "
        "database format, written as text here (a notice says so)"))
    profile_level: Literal["level_none", "level0", "level1", "level2"] = setting("level0", (
        "torch_npu's collection level on Ascend; torch's profiler has no levels and records "
        "every operator (accepted for MindSpeed-RL's configs)"))
    profile_with_memory: bool = setting(False, "record tensor allocations (profile_memory)")
    profile_record_shapes: bool = setting(False, "record operator input shapes")
    profile_with_cpu: bool = setting(True, "record host-side operators (ProfilerActivity.CPU)")
    profile_with_npu: bool = setting(True, (
        "record the accelerator's kernels (ProfilerActivity.CUDA when CUDA is present)"))
    profile_with_module: bool = setting(False, "record Python call stacks (with_stack)")
    profile_step_start: int = setting(1, (
        "first profiled iteration, counted from 1 at the start of this launch (as "
        "MindSpeed-RL counts, also after a resume)"))
    profile_step_end: int = setting(2, "first iteration no longer profiled (the range is "
                                       "[profile_step_start, profile_step_end))")
    profile_analysis: bool = setting(False, (
        "also write each trace's operator summary (key_averages, sorted by self time) as "
        "a .txt next to it"))
    profile_ranks: str | tuple[int, ...] = setting("all", "all, or the list of ranks that "
                                                          "record, e.g. [0]")


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """``profiler_config``: MindSpeed-RL's profiler section; only its ``integrated`` role (every
    role shares the actor's ranks)."""

    integrated: ProfilerSettings = setting(ProfilerSettings, "the profiler of the co-located "
                                                             "roles")


# YAML section name -> its dataclass; the order is the order of the docs and of to_dict().
SECTIONS: dict[str, type] = {
    "megatron_training": MegatronTrainingConfig,
    "actor_config": ActorConfig,
    "ref_config": RefConfig,
    "rl_config": RLConfig,
    "generate_config": GenerateConfig,
    "critic_config": CriticConfig,
    "reward_config": RewardConfig,
    "teacher_config": TeacherConfig,
    "profiler_config": ProfilerConfig,
}
# Sections a job may leave out entirely (None in RLJobConfig when absent).
OPTIONAL_SECTIONS = frozenset({"critic_config", "reward_config", "teacher_config"})


@dataclass(frozen=True, kw_only=True)
class RLJobConfig:
    """A loaded, validated job: the YAML sections plus the model's architecture.

    ``model`` is not a YAML section: it is read from ``megatron_training.model``
    (config.json or a configs/model yaml). ``config_path`` is the file it came
    from, absolute. ``algorithm`` is the launcher's family (``grpo`` or ``ppo``); the
    optional sections are None when the file leaves them out.
    """

    megatron_training: MegatronTrainingConfig
    actor_config: ActorConfig
    rl_config: RLConfig
    generate_config: GenerateConfig
    critic_config: CriticConfig | None = None
    reward_config: RewardConfig | None = None
    teacher_config: TeacherConfig | None = None
    model: ModelSpec
    config_path: str
    algorithm: str = "grpo"  # a registered family (mindspeed_rl/algorithms/registry.py)
    ref_config: RefConfig = field(default_factory=RefConfig)
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    # MindSpeed-RL keys accepted without effect, with the reason (printed once at start-up).
    notices: tuple[str, ...] = ()
    # values MindSpeed-RL accepts that run as MindSpeed-RL runs them, though they look wrong
    # (a mini-batch larger than the batch...): one line each, printed with the plan.
    warnings: tuple[str, ...] = ()

    @property
    def sampling_config(self) -> SamplingConfig:
        return self.generate_config.sampling_config

    @property
    def features(self):
        """The optional parts of the loop this job runs (``mindspeed_rl/config/features.py``),
        decided from the config alone: read by the trainer, the sample flow, the engines
        and the checks."""
        from mindspeed_rl.config.features import features

        return features(self)

    @property
    def generation_dtype(self) -> str:
        """vLLM's dtype with ``auto`` resolved: the training precision (bf16 or fp32)."""
        if self.generate_config.dtype != "auto":
            return self.generate_config.dtype
        return "bfloat16" if self.megatron_training.bf16 else "float32"

    def to_dict(self) -> dict[str, dict]:
        """The effective configuration as YAML-ready sections (loads back to the same job)."""
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS
                if getattr(self, name) is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
