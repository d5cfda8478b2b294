"""MindSpeed-RL's older config formats, the per-role packing budgets, EPLB, and the values
MindSpeed-RL accepts that look wrong (pure Python, no torch).

The configs here are written for these tests in the formats MindSpeed-RL shipped: its
separate-worker format of March 2025 (reference and reward model with NPUs and layouts of
their own, experience_count, mini_batch_size counted in responses) and its integrated worker
of May 2025 (update_micro_batch_size). The last test dry-runs MindSpeed-RL's own configs
across its history when its git mirror is on this machine (skipped otherwise).
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import load_config, main, make_plan
from mindspeed_rl.config.batch_plan import packing_budgets
from mindspeed_rl.config.config_error import ConfigErrors
from test_mindspeed_rl_config import error_of  # (tests/ is on sys.path: conftest.py)

# MindSpeed-RL's model yaml of March 2025 (Megatron names under the model name, no
# norm_epsilon, and training keys its loader merged into the job's Megatron settings).
MODEL_YAML = """\
tiny_qwen:
  use_mcore_models: true
  num_layers: 4
  hidden_size: 128
  ffn_hidden_size: 256
  num_attention_heads: 8
  seq_length: 4096
  rotary_base: 1000000
  max_position_embeddings: 4096
  make_vocab_size_divisible_by: 1
  padded_vocab_size: 512
  untie_embeddings_and_output_weights: true
  add_qkv_bias: true
  disable_bias_linear: true
  group_query_attention: true
  num_query_groups: 4
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  adam_beta1: 0.9
  adam_beta2: 0.97
  position_embedding_type: rope
  normalization: RMSNorm
  use_fused_rmsnorm: true
  swiglu: true
  use_flash_attn: true
  attention_softmax_in_fp32: true
  bf16: true
"""

# The separate-worker format of MindSpeed-RL's March 2025 configs (grpo_trainer_*): the
# reference and a reward model on NPUs and layouts of their own, rule_reward false, keys
# of that time (experience_count, colocate_*, generate_config.micro_batch_size) and keys its
# configs carried that it never read (kl_coef, missing_eos_penalty).
MARCH_2025 = """\
defaults:
  - model:
      - tiny_qwen

megatron_training:
  model: tiny_qwen
  use_fused_rmsnorm: true
  use_mcore_models: true
  sequence_parallel: true
  use_flash_attn: true
  no_masked_softmax_fusion: true
  bf16: true
  use_distributed_optimizer: true
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: ./tok
  global_batch_size: 8
  seq_length: 512
  save_interval: 10000
  train_iters: 1000
  stage: ray_grpo
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  distributed_backend: nccl
  no_shared_storage: true
  variable_seq_lengths: true
  norm_epsilon: 1e-6
  dataset_additional_keys: ['labels',]
  data_path: ./dataset/data
  split: 100,0,0

actor_config:
  model: tiny_qwen
  micro_batch_size: 1
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 1
  lr: 1e-7
  lr_decay_style: constant
  min_lr: 0.0
  weight_decay: 0.0
  lr_warmup_fraction: 0.0
  clip_grad: 10000.0
  initial_loss_scale: 4096
  finetune: true
  load: ./ckpt
  save: ./ckpt
  no_load_optim: true
  no_load_rng: true

ref_config:
  model: tiny_qwen
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  micro_batch_size: 2
  load: ./ckpt
  no_load_optim: true
  no_load_rng: true

reward_config:
  model: tiny_qwen
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  micro_batch_size: 1
  load: ./rm_ckpt
  no_load_optim: true
  no_load_rng: true

rl_config:
  blocking: false
  experience_count: 2
  gamma: 1.0
  lam: 0.95
  adv_estimator: group_norm
  kl_penalty: kl
  kl_ctrl_type: fixed
  kl_coef: 0.05
  missing_eos_penalty: 0.0
  init_kl_coef: 0.05
  mini_batch_size: 8
  max_prompt_length: 256
  epochs: 1
  clip_ratio: 0.2
  entropy_coeff: 0.001
  shuffle_minibatch: false
  n_samples_per_prompt: 2
  rule_reward: false
  colocate_actor_ref: false
  colocate_all_models: false
  num_cpus_for_local_task: 1.0
  num_cpus_for_placement_group: 8
  actor_resource:
    num_npus: 4
  reference_resource:
    num_npus: 2
  reward_resource:
    num_npus: 2

generate_config:
  micro_batch_size: 1
  trust_remote_code: true
  infer_tensor_parallel_size: 4
  infer_pipeline_parallel_size: 1
  infer_expert_parallel_size: 1
  max_num_seqs: 16
  max_model_len: 1024
  dtype: "bfloat16"
  gpu_memory_utilization: 0.6
  offload_train_optimizer: true
  offload_train_grad: true
  offload_train_param: true
  sampling_config:
    logprobs: 1
    max_tokens: 256
    top_p: 0.9
    top_k: 50
    min_p: 0.01
    temperature: 0.9
    detokenize: false
"""

# MindSpeed-RL's integrated worker of May 2025 (r1_zero_qwen25_7b_integrated,
# grpo_qwen25_7b_integrated): update_micro_batch_size, a mini-batch larger than the batch
# and a seq_length below max_prompt_length.
MAY_2025 = """\
defaults:
  - model:
      - tiny_qwen

megatron_training:
  model: tiny_qwen
  bf16: true
  tokenizer_name_or_path: ./tok
  global_batch_size: 4
  seq_length: 512
  train_iters: 2
  stage: ray_grpo
  data_path: ./data
  split: 100,0,0

actor_config:
  model: tiny_qwen
  micro_batch_size: 2
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 1
  lr: 5e-7
  load: ./ckpt
  save: ./ckpt

rl_config:
  use_integrated_worker: true
  blocking: true
  update_micro_batch_size: 1
  gamma: 1.0
  lam: 0.95
  adv_estimator: group_norm
  kl_penalty: kl
  init_kl_coef: 0.0001
  mini_batch_size: 256
  max_prompt_length: 768
  epochs: 1
  n_samples_per_prompt: 8
  rule_reward: true
  verifier_function: ["base_acc"]
  verifier_weight: [1.0]
  actor_resource:
    num_npus: 8

generate_config:
  infer_tensor_parallel_size: 2
  max_num_seqs: 64
  max_model_len: 1024
  sampling_config:
    max_tokens: 256
    temperature: 0.8
"""


@pytest.fixture
def msrl(tmp_path, monkeypatch):
    """Write a MindSpeed-RL-format job (with edits) beside model/tiny_qwen.yaml; cd there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny_qwen.yaml").write_text(MODEL_YAML)

    def write(text: str, *, replace: dict[str, str] | None = None) -> Path:
        for old, new in (replace or {}).items():
            assert old in text, old
            text = text.replace(old, new)
        path = tmp_path / "job.yaml"
        path.write_text(text)
        return path

    return write


def notice(config, start: str) -> str:
    found = [n for n in config.notices if n.startswith(start)]
    assert len(found) == 1, (start, config.notices)
    return found[0]


# ---- the separate-worker format (March 2025) ----------------------------------------------

def test_march_2025_separate_worker_format_loads_and_plans(msrl, capsys):
    path = msrl(MARCH_2025)
    config = load_config(path, check_data=False)
    rl, a, reward = config.rl_config, config.actor_config, config.reward_config
    # the reward model of reward_resource, in the actor's layout; no rule verifiers
    assert reward is not None and reward.load == str(Path("rm_ckpt").absolute())
    assert reward.tensor_model_parallel_size is None and reward.micro_batch_size == 1
    assert rl.verifier_function == () and rl.verifier_weight == ()
    # responses then: 8 responses / 2 samples = 4 prompts per optimizer step
    assert rl.mini_batch_size == 4
    assert rl.ref_forward_micro_batch_size == 2        # ref_config.micro_batch_size
    assert config.model.rms_norm_eps == 1e-6           # megatron_training.norm_epsilon
    # the model yaml's training keys fill what the job leaves out; the job's win
    assert a.adam_beta2 == 0.97 and config.megatron_training.seq_length == 512
    assert notice(config, "ref_config.tensor_model_parallel_size=2, "
                          "pipeline_model_parallel_size=1: the reference's layout on NPUs of its "
                          "own").endswith("in that layout of its own (a second set of "
                                          "megatron groups), which computes the same log-probs")
    r = config.ref_config  # run so: TP 2 x PP 1 beside the actor's TP 4 x PP 1
    assert (r.tensor_model_parallel_size, r.pipeline_model_parallel_size) == (2, 1)
    assert "(an older MindSpeed-RL key: MindSpeed-RL master 2025-03-26 to 2025-05-15" in notice(
        config, "rl_config.experience_count=2")
    assert "before release 2.0.0" in notice(config, "generate_config.micro_batch_size=1")
    assert "never a key of its config classes" in notice(config, "rl_config.kl_coef=0.05")
    assert "translated to 4 prompts (8 / n_samples_per_prompt=2)" in notice(
        config, "rl_config.mini_batch_size=8")
    assert "leaves out" in notice(config, "megatron_training.norm_epsilon=1e-06")
    assert notice(config, "rl_config.rule_reward=false") == (
        "rl_config.rule_reward=false: no rule verifiers, the reward model alone")
    # their actor_resource.num_npus
    assert main(["--config", str(path), "--dry-run", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "dry-run OK" in out and "reward model (" in out
    assert "reference  runs in its own layout: TP 2 x PP 1 x DP 2 over the actor's ranks" in out
    assert main(["--config", str(path), "--dry-run", "--world-size", "4",
                 "ref_config.tensor_model_parallel_size=3"]) == 2
    assert "ref_config.tensor_model_parallel_size=3: TP=3 x PP=1 does not divide the world of " \
        "4 ranks" in capsys.readouterr().err


def test_reward_config_without_reward_resource_is_not_read(msrl):
    """r1_zero_* (March 2025): a reward_config beside rule rewards, but no reward_resource,
    so MindSpeed-RL built no reward model from it."""
    config = load_config(msrl(MARCH_2025, replace={
        "  reward_resource:\n    num_npus: 2\n": "",
        "  rule_reward: false\n": "  rule_reward: true\n  verifier_function: [math_17k_acc]\n"
                                  "  verifier_weight: [1.0]\n"}), check_data=False)
    assert config.reward_config is None and config.rl_config.verifier_function == ("math_17k_acc",)
    assert notice(config, "reward_config: not read")


def test_rule_reward_false_without_a_reward_model_is_refused(msrl):
    path = msrl(MARCH_2025, replace={"  reward_resource:\n    num_npus: 2\n": ""})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("rl_config.rule_reward=false: leaves no reward")


def test_reference_layout_in_the_integrated_format_is_refused(msrl):
    """MindSpeed-RL refuses ref_config with use_integrated_worker: true; so does this project
    (its reference runs in the actor's layout there)."""
    path = msrl(MAY_2025 + "ref_config:\n  tensor_model_parallel_size: 2\n")
    text = str(error_of(load_config, path, check_data=False))
    assert "ref_config.tensor_model_parallel_size=2: the reference model runs in the actor's " \
           "layout" in text


def test_mini_batch_in_responses_must_split_into_prompts(msrl):
    path = msrl(MARCH_2025, replace={"  mini_batch_size: 8\n": "  mini_batch_size: 7\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("rl_config.mini_batch_size=7: counts responses in this file's "
                           "MindSpeed-RL version (rl_config.experience_count dates it")


def test_norm_epsilon_that_contradicts_the_model_is_refused(msrl, tmp_path):
    (tmp_path / "model" / "tiny_qwen.yaml").write_text(MODEL_YAML + "  norm_epsilon: 1e-5\n")
    text = str(error_of(load_config, msrl(MARCH_2025), check_data=False))
    assert "megatron_training.norm_epsilon=1e-06: the model's norm_epsilon is 1e-05" in text
    assert "remove the key, or set norm_epsilon in the model's file" in text


def test_qk_layernorm_for_a_model_without_qk_norms_is_refused(msrl):
    path = msrl(MARCH_2025, replace={"  stage: ray_grpo\n": "  stage: ray_grpo\n"
                                                           "  qk_layernorm: true\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("megatron_training.qk_layernorm=true: the model (qwen2, in "
                           "tiny_qwen.yaml) has no q/k norms"), text
    assert "remove the key (the model's file decides: its model_type, or qk_layernorm in a " \
           "MindSpeed-RL model yaml)" in text


# ---- the integrated worker of May 2025, and values MindSpeed-RL accepts ---------------------

def test_may_2025_integrated_format_runs_as_mindspeed_rl_ran_it(msrl, capsys):
    path = msrl(MAY_2025, replace={"  seq_length: 512\n": "  seq_length: 256\n"})
    config = load_config(path, check_data=False)
    rl, a = config.rl_config, config.actor_config
    # update_micro_batch_size is the update's; micro_batch_size then sized the forwards
    assert a.micro_batch_size == 1
    assert rl.actor_forward_micro_batch_size == 2 and rl.ref_forward_micro_batch_size == 2
    # 256 prompts per step of a batch of 4: one step over the whole batch
    assert rl.mini_batch_size == 4
    assert config.warnings == (
        "rl_config.mini_batch_size=256 is larger than megatron_training.global_batch_size=4: "
        "one mini-batch of all 4 prompts (one optimizer step per epoch), as MindSpeed-RL runs "
        "it; set mini_batch_size: 4 to say so",
        "megatron_training.seq_length=256 is shorter than rl_config.max_prompt_length=768: "
        "prompts longer than 256 tokens are cut to their first 256 tokens (those longer than "
        "768 dropped first), as MindSpeed-RL reads its prompt data; raise seq_length to 768 to "
        "keep whole prompts")
    assert main(["--config", str(path), "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("warning: rl_config.mini_batch_size=256 is larger")
    assert out[2].startswith("warning: megatron_training.seq_length=256 is shorter")


def test_update_micro_batch_size_is_read_only_by_the_integrated_worker(msrl):
    config = load_config(msrl(MARCH_2025, replace={
        "  experience_count: 2\n": "  experience_count: 2\n  update_micro_batch_size: 2\n"}),
        check_data=False)
    assert config.actor_config.micro_batch_size == 1
    assert "not read" in notice(config, "rl_config.update_micro_batch_size=2")


def test_old_keys_with_values_that_cannot_be_honoured_name_their_version(msrl):
    path = msrl(MAY_2025, replace={"  max_num_seqs: 64\n": "  max_num_seqs: 64\n"
                                   "  infer_prefill_context_parallel_size: 2\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("generate_config.infer_prefill_context_parallel_size=2: cannot be "
                           "honoured here (an older MindSpeed-RL key: MindSpeed-RL master "
                           "2026-01-15 (reverted the same day))")


# ---- unknown keys: an older MindSpeed-RL key, or never one --------------------------------

def test_unknown_key_wording_tells_old_keys_from_never_keys(msrl):
    path = msrl(MAY_2025, replace={"  max_num_seqs: 64\n": "  max_num_seqs: 64\n"
                                   "  experience_count: 4\n",
                                   "  blocking: true\n": "  blocking: true\n"
                                   "  rollout_bonus: 3\n"})
    error = error_of(load_config, path, check_data=False)
    assert isinstance(error, ConfigErrors) and len(error.errors) == 2
    never, old = (str(e) for e in error.errors)          # in the order of the sections
    assert old == ("generate_config.experience_count: unknown key; it belongs in another section "
                   "(an older MindSpeed-RL key: MindSpeed-RL master 2025-03-26 to 2025-05-15, "
                   "before release 2.0.0): did you mean rl_config.experience_count?")
    assert never == ("rl_config.rollout_bonus: unknown key; never a MindSpeed-RL key: neither "
                     "this project nor any MindSpeed-RL version (2025-03 to 2026-04) has it in "
                     "rl_config; see docs/config.md for the keys of each section")


# ---- the packing budget of each role -----------------------------------------------------

DAPO_20K = """\
megatron_training:
  model: tiny_qwen
  tokenizer_name_or_path: ./tok
  global_batch_size: 16
  seq_length: 512
  stage: ray_dapo
  data_path: ./data
actor_config:
  tensor_model_parallel_size: 4
rl_config:
  use_remove_padding: true
  use_dynamic_bsz: true
  actor_max_packing_token_size: 4096
  update_max_packing_token_size: 2048
  mini_batch_size: 8
  max_prompt_length: 512
  n_samples_per_prompt: 4
  verifier_function: [acc_for_dapo]
  verifier_weight: [1.0]
generate_config:
  infer_tensor_parallel_size: 4
  max_model_len: 2048
  sampling_config:
    max_tokens: 1536
"""


def test_packing_budgets_are_read_per_role_as_mindspeed_rl_reads_them(msrl):
    """dapo_qwen25_32b_A2_20k.yaml's shape: the update and old log-prob budgets hold the
    longest row (2048 tokens), the base (below it) is only their default; DAPO builds no
    reference model, whose budget would fall back to the base."""
    small_base = DAPO_20K.replace("  use_dynamic_bsz: true\n",
                                  "  use_dynamic_bsz: true\n  max_packing_token_size: 1024\n")
    config = load_config(msrl(small_base), check_data=False)
    assert config.rl_config.init_kl_coef == 0            # MindSpeed-RL's DAPO: no reference
    assert packing_budgets(config) == {"update": "update_", "old_log_p": "actor_"}
    make_plan(config, 16)
    # the same budgets with a reference model: its budget falls back to the base
    text = str(error_of(load_config, msrl(small_base.replace("  stage: ray_dapo\n", "")),
                        check_data=False))
    assert text.startswith("rl_config.max_packing_token_size=1024: smaller than the longest "
                           "single row (the reference_model phase's budget: rl_config."
                           "ref_max_packing_token_size is not set): rl_config.max_prompt_length"
                           "=512 + generate_config.sampling_config.max_tokens=1536 = 2048 tokens")


def test_a_role_budget_is_checked_only_when_its_phase_runs(msrl):
    small_actor = DAPO_20K.replace("actor_max_packing_token_size: 4096",
                                   "actor_max_packing_token_size: 1024")
    # one optimizer step per iteration: no old log-prob forward, its budget is not used
    config = load_config(msrl(small_actor.replace("  mini_batch_size: 8\n",
                                                  "  mini_batch_size: 16\n")), check_data=False)
    assert "old_log_p" not in packing_budgets(config)
    text = str(error_of(load_config, msrl(small_actor), check_data=False))
    assert text.startswith("rl_config.actor_max_packing_token_size=1024: smaller than the "
                           "longest single row: ")


def test_dapo_stage_has_no_reference_model(msrl):
    config = load_config(msrl(DAPO_20K.replace("  mini_batch_size: 8\n",
                                               "  mini_batch_size: 8\n  init_kl_coef: 0.01\n")),
                         check_data=False)
    assert config.rl_config.init_kl_coef == 0
    assert "has no reference model" in notice(config, "rl_config.init_kl_coef=0.01: not read")
    assert make_plan(config, 16).memory_bytes["reference_params"] == 0


# ---- EPLB ---------------------------------------------------------------------------------

MOE_MODEL = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
             "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
             "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
             "vocab_size": 512, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}


def test_expert_map_is_npu_only_and_said_once(msrl, tmp_path):
    from mindspeed_rl.rollout.vllm_engine import expert_map_kwargs

    (tmp_path / "moe.yaml").write_text(yaml.safe_dump(MOE_MODEL))
    text = textwrap.dedent("""\
        megatron_training:
          model: moe.yaml
          tokenizer_name_or_path: ./tok
          data_path: ./data
        generate_config:
          infer_tensor_parallel_size: 2
          enable_expert_parallel: true
          expert_map_path: ./expert_map.json
          eplb_token_collects: false
          eplb_token_save_path: ./json_file
        """)
    config = load_config(msrl(text), check_data=False)
    path = str(tmp_path / "expert_map.json")
    assert config.generate_config.expert_map_path == path
    said = [n for n in config.notices if n.startswith("generate_config.expert_map_path=")]
    assert len(said) == 1 and "NPU only: passed to vLLM on NPU" in said[0]
    assert "no files are written here" in notice(config, "generate_config.eplb_token_collects")
    assert expert_map_kwargs(path, "npu") == {"additional_config": {"expert_map_path": path}}
    assert expert_map_kwargs(path, "cpu") == {} == expert_map_kwargs(path, "cuda")
    assert expert_map_kwargs(None, "npu") == {}
    # a map places experts on vLLM's expert-parallel ranks: it needs them
    text = str(error_of(load_config, msrl(text.replace("  enable_expert_parallel: true\n", "")),
                        check_data=False))
    assert text.startswith("generate_config.expert_map_path=")
    assert "set enable_expert_parallel: true" in text


# ---- MindSpeed-RL's own configs across its history (its git mirror) ----------------------

MSRL = Path("/work/.mirror/Ascend+MindSpeed-RL/repo")

# file @ commit -> the result of the dry run at its actor_resource.num_npus: "OK", or the
# start of the refusal: one version of each format; every version of every file is in the
# table of docs/config.md.
HISTORY = {
    # the separate-worker format (March and April 2025)
    "grpo_trainer_qwen25_7b.yaml@a125bfd": "OK",      # its tokenizer left blank to fill in
    "grpo_trainer_qwen25_7b.yaml@7531796": "OK",      # rule_reward false: a reward model
    "grpo_trainer_qwen25_32b.yaml@94d79a0": "OK",     # a model yaml with training keys
    "grpo_trainer_qwen25_32b.yaml@7531796": "OK",
    "r1_zero_qwen25_7b.yaml@db53f97": "OK",
    "r1_zero_qwen25_7b.yaml@1d725df": "OK",
    "r1_zero_qwen25_32b.yaml@e91b96f": "OK",
    # the integrated worker (May 2025): update_micro_batch_size, mini-batches beyond the batch
    "r1_zero_qwen25_7b_integrated.yaml@6a5b469": "OK",
    "grpo_qwen25_7b_integrated.yaml@12fdd5e": "OK",
    "grpo_qwen25_7b_A2.yaml@b0ff6bb": "OK",
    "grpo_trainer_qwen25_7b_A3.yaml@fea8ddc": "OK",
    "ppo_qwen25_7b_integrated.yaml@923b148": "OK",
    "ppo_qwen25_7b_A2.yaml@5c24078": "OK",
    "ppo_qwen25_32b_integrated.yaml@923b148": "OK",
    # DAPO's filter_groups_metric as a metric name; moe_intermediate_size in a model yaml
    "dapo_qwen25_32b_A3.yaml@50d3d96": "OK",
    "dapo_qwen3_30b_a3b_A3.yaml@b41f986": "OK",
    "dapo_trainer_qwen25_32b_32k.yaml@e899876": "OK",
    "dapo_qwen25_7b_A2_multi_turn.yaml@88bc30d": "OK",
    "grpo_qwen3_235b_a22b_A2.yaml@4f551e3": "OK",
    # long context: TP 8 x CP 2 (ring) x PP 2 on 64 NPUs
    "dapo_qwen25_32b_A2_20k.yaml@6628b6e": "OK",
    "dapo_qwen25_32b_A3_32k.yaml@6628b6e": "OK",
    # DeepSeek-V3 671B: the separate-worker format (TP 32 x PP 12), MindSpeed-RL 2.0.0's
    # model-yaml names at 384 ranks (TP 4 x PP 6, EP 16 x TP 4), today's names at 256
    "grpo_trainer_deepseekv3_671b.yaml@e05a299": "OK",
    "grpo_deepseek_r1_671b_A3.yaml@de08cc4": "OK",
    "grpo_deepseek_r1_671b_A3.yaml@d76a536": "OK",
    "grpo_deepseek_r1_671b_A3.yaml@4f551e3": "OK",
    # a longest prompt's response stops 4 tokens short of max_tokens, at max_model_len: a warning
    "grpo_deepseek_r1_671b_A2.yaml@4f551e3": "OK",
    # DPO (pretrain_dpo.py): Qwen3-30B-A3B at TP 2 x PP 8, hyphenated min-lr, their first
    # and latest versions
    "dpo_qwen3_30b_a3b_A3.yaml@870967a": "OK",
    "dpo_qwen3_30b_a3b_A3.yaml@c25365f": "OK",
    # refused: no data path
    "grpo_trainer_qwen25_7b.yaml@8eddc32": "megatron_training.data_path=null: required key is "
                                           "empty",
    "grpo_trainer_llama32_1b.yaml@76d7796": "megatron_training.data_path: required key is "
                                            "missing",
}


def _show(commit: str, path: str) -> str | None:
    done = subprocess.run(["git", "-C", str(MSRL), "show", f"{commit}:{path}"],
                          capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
@pytest.mark.parametrize("entry", sorted(HISTORY))
def test_mindspeed_rl_configs_across_its_history(entry, tmp_path, monkeypatch):
    """Their file unchanged, with their model yamls of the same commit, at their own
    actor_resource.num_npus (pretrain_ppo.py's algorithm for ppo_*, pretrain_dpo.py's for
    dpo_*)."""
    name, commit = entry.split("@")
    text = _show(commit, f"configs/{name}")
    for folder, into in (("configs/model", tmp_path / "model"),
                         ("configs/tools", tmp_path / "configs" / "tools")):
        into.mkdir(parents=True)
        for item in (_show(commit, folder) or "").splitlines()[1:]:  # "tree ..." then names
            if item.endswith(".yaml"):
                (into / item).write_text(_show(commit, f"{folder}/{item}"))
    (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(text)
    algorithm = {"ppo_": "ppo", "dpo_": "dpo"}.get(name[:4], "grpo")
    world = raw.get("rl_config", {}).get("actor_resource", {}).get("num_npus", 1)
    if algorithm == "dpo":  # a DPO config has no resources: its TP x PP (DP 1), 16 for theirs
        mt = raw["megatron_training"]
        world = mt["tensor_model_parallel_size"] * mt["pipeline_model_parallel_size"]
    argv = ["--config", name, "--dry-run", "--world-size", str(world), "--algorithm", algorithm]
    if HISTORY[entry] == "OK":
        config = load_config(name, check_data=False, algorithm=algorithm)
        make_plan(config, world)
    else:
        error = error_of(load_config, name, check_data=False, algorithm=algorithm)
        assert HISTORY[entry] in str(error), str(error)
    assert main(argv) == (0 if HISTORY[entry] == "OK" else 2)


def _their_files(commit: str, name: str, into: Path) -> None:
    """configs/<name> of MindSpeed-RL at ``commit`` in ``into``, its model yamls in model/."""
    (into / "model").mkdir(exist_ok=True)
    for item in (_show(commit, "configs/model") or "").splitlines()[1:]:
        if item.endswith(".yaml"):
            (into / "model" / item).write_text(_show(commit, f"configs/model/{item}"))
    (into / name).write_text(_show(commit, f"configs/{name}"))


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
def test_their_dpo_config_reads_min_lr_and_qk_layernorm(tmp_path, monkeypatch):
    """MindSpeed-RL's DPO config as published: ``min-lr: 0`` (Megatron's spelling) read as
    min_lr, ``qk_layernorm: true`` as the Qwen3-MoE's own q/k norms, its DPO keys as
    pretrain_dpo.py's, ``ref_model`` as the reference's checkpoint."""
    name = "dpo_qwen3_30b_a3b_A3.yaml"
    _their_files("05a90d7", name, tmp_path)
    text = (tmp_path / name).read_text()
    assert "  min-lr: 0\n" in text and "  qk_layernorm: true\n" in text
    monkeypatch.chdir(tmp_path)
    config = load_config(name, check_data=False, algorithm="dpo")
    assert config.actor_config.min_lr == 0 and config.model.model_type == "qwen3_moe"
    assert config.features.phases == ("pairs", "reference_model", "preference_update")
    assert config.ref_config.load.endswith("Qwen3-30B-TP2-PP8-EP1")
    assert config.actor_config.lr == 5e-8 and config.megatron_training.dpo_loss_type == "sigmoid"
    assert notice(config, "megatron_training.min-lr=0").endswith("read as megatron_training."
                                                                 "min_lr (MindSpeed-RL reads '-' "
                                                                 "in a key as '_', as Megatron's "
                                                                 "argument parser does)")
    assert notice(config, "megatron_training.qk_layernorm=true") == (
        "megatron_training.qk_layernorm=true: the model (qwen3_moe, in qwen3_30b_a3b.yaml) has "
        "q/k norms: the same")
    plan = make_plan(config, 16)
    assert (plan.layout.tensor_model_parallel_size, plan.layout.pipeline_model_parallel_size,
            plan.layout.data_parallel_size) == (2, 8, 1)
    assert plan.batch.responses_per_iteration == 128 and not plan.engine   # 64 pairs


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
def test_responses_past_max_model_len_stop_there_with_a_warning(tmp_path, monkeypatch, capsys):
    """MindSpeed-RL's grpo_deepseek_r1_671b_A2.yaml: max_prompt_length 8196 + max_tokens 2048
    = 10244 > max_model_len 10240. vLLM stops a response at max_model_len (finish reason
    "length"): the job runs, warned, and the engine asks a longest prompt for 2044 tokens."""
    from mindspeed_rl.rollout.vllm_engine import RolloutConfigError, response_budgets

    name = "grpo_deepseek_r1_671b_A2.yaml"
    _their_files("4f551e3", name, tmp_path)
    monkeypatch.chdir(tmp_path)
    config = load_config(name, check_data=False)
    line = ("generate_config.sampling_config.max_tokens=2048: rl_config.max_prompt_length=8196 "
            "+ max_tokens=2048 = 10244 is larger than generate_config.max_model_len=10240: vLLM "
            "stops the response to a longest prompt at max_model_len, 4 tokens short of "
            "max_tokens (finish reason \"length\"), as MindSpeed-RL runs it; set max_tokens: "
            "2044 to say so, or max_model_len: 10244 for whole responses")
    assert config.warnings == (line,)
    assert main(["--config", name, "--dry-run", "--world-size", "256"]) == 0
    assert f"\nwarning: {line}\n" in capsys.readouterr().out
    # the engine's SamplingParams (RolloutEngine._params): max_tokens within max_model_len
    # for a longest prompt, min_tokens within max_tokens
    mml, sampling = config.generate_config.max_model_len, config.sampling_config
    assert response_budgets([8196, 100], [sampling.max_tokens] * 2, [2046, 2046], mml) == (
        [2044, 2048], [2044, 2046])
    with pytest.raises(RolloutConfigError, match="prompt 1 has 10240 tokens: it leaves no room"):
        response_budgets([8196, 10240], [2048] * 2, [0] * 2, mml)
    # what cannot run is refused: a prompt limit that fills max_model_len
    error = error_of(load_config, name, ["rl_config.max_prompt_length=10240",
                                         "megatron_training.seq_length=10240"], check_data=False)
    assert str(error).startswith("rl_config.max_prompt_length=10240: a longest prompt leaves no "
                                 "room for a response in generate_config.max_model_len=10240; "
                                 "lower max_prompt_length to at most 10239"), error


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
def test_their_dapo_qwen3_moe_config_with_r3_runs_without_prefix_caching(tmp_path, monkeypatch,
                                                                         capsys):
    """MindSpeed-RL's dapo_qwen3_30b_a3b_A3.yaml (its latest version, 2025-12-18) with
    rl_config.router_replay=R3 at its 16 NPUs: prefix caching (this project's default; the
    file leaves it out) is turned off for the run, one line in the plan."""
    name = "dapo_qwen3_30b_a3b_A3.yaml"
    _their_files("4f551e3", name, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINDSPEED_RL_DEVICE", "cpu")   # R3's capture: vLLM's routers (CPU, CUDA)
    config = load_config(name, ["rl_config.router_replay=R3"], check_data=False)
    assert config.features.replays_rollout_routing
    assert config.generate_config.enable_prefix_caching is False
    line = ("generate_config.enable_prefix_caching=true (the default): turned off for "
            "rl_config.router_replay R3")
    assert main(["--config", name, "--dry-run", "--world-size", "16",
                 "rl_config.router_replay=R3"]) == 0
    out = capsys.readouterr().out
    assert "dry-run OK" in out and sum(line in row for row in out.splitlines()) == 1
    # without R3 the file runs as it did, with the cache
    assert load_config(name, check_data=False).generate_config.enable_prefix_caching


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
def test_the_published_deepseek_r1_671b_job_plans_its_layout(tmp_path, monkeypatch):
    """MindSpeed-RL's grpo_deepseek_r1_671b_A3.yaml of 2025-08-27 with its model yaml, at its
    384 ranks: TP 4 x PP 6 (9,10,10,10,11,11 layers) x EP 16 (x TP 4, moe_tp_extend_ep)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "deepseekv3_671b.yaml").write_text(
        _show("d76a536", "configs/model/deepseekv3_671b.yaml"))
    (tmp_path / "job.yaml").write_text(_show("d76a536", "configs/grpo_deepseek_r1_671b_A3.yaml"))
    monkeypatch.chdir(tmp_path)
    plan = make_plan(load_config("job.yaml", check_data=False), 384)
    train = plan.to_dict()["layout"]["training"]
    assert (train["tensor_model_parallel_size"], train["pipeline_model_parallel_size"],
            train["data_parallel_size"], train["expert_model_parallel_size"]) == (4, 6, 16, 64)
    assert plan.layout_notes[0].startswith("pipeline stages: 9,10,10,10,11,11 layers")
    assert "expert_model_parallel_size 16 x TP 4 (moe_tp_extend_ep" in plan.layout_notes[1]
    assert plan.model["num_parameters"] == 671_026_404_352
    assert plan.parameters["training_per_rank"] == 2_825_460_736   # the 11 MoE layers' stage


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror at " + str(MSRL))
def test_a_deepseek_reference_layout_must_split_multi_latent_attention(tmp_path, monkeypatch):
    """March 2025's DeepSeek-V3 job runs its reference at TP 32; at TP 128 the heads still
    split, the KV down projection (512 + 64 rows) does not."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "deepseekv3_671b.yaml").write_text(
        _show("e05a299", "configs/model/deepseekv3_671b.yaml"))
    text = _show("e05a299", "configs/grpo_trainer_deepseekv3_671b.yaml")
    ref = text.index("ref_config:")
    text = text[:ref] + text[ref:].replace("tensor_model_parallel_size: 32",
                                           "tensor_model_parallel_size: 128", 1)
    (tmp_path / "job.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    error = error_of(make_plan, load_config("job.yaml", check_data=False), 384)
    assert str(error).startswith("ref_config.tensor_model_parallel_size=128: TP=128 does not "
                                 "split the model's multi-latent attention down projections"), error
