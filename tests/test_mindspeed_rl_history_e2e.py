"""An older MindSpeed-RL config end to end: torchrun + pretrain_grpo.py, 2 ranks, tiny model.

One launch carries two of MindSpeed-RL's historical formats: the job in its separate-worker
format of March 2025 (a reference with a layout of its own, a reward_config without
reward_resource, experience_count, mini_batch_size counted in responses, keys it never
read) and its model yaml of that time (Megatron names plus training keys, norm_epsilon
given by the job), with a value of its May 2025 configs (seq_length below
max_prompt_length, so prompts are cut as MindSpeed-RL cut them).
"""

from __future__ import annotations

import math

import pytest
from torchrun_jobs import run_job, training_rows

from mindspeed_rl.data import load_prompt_dataset, make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

# The tiny qwen2 of mindspeed_rl.models.tiny in MindSpeed-RL's model-yaml form of March 2025.
MODEL_YAML = """\
tiny_qwen:
  use_mcore_models: true
  num_layers: 2
  hidden_size: 128
  ffn_hidden_size: 256
  num_attention_heads: 4
  seq_length: 4096
  rotary_base: 1000000
  max_position_embeddings: 256
  make_vocab_size_divisible_by: 1
  padded_vocab_size: 384
  untie_embeddings_and_output_weights: true
  add_qkv_bias: true
  disable_bias_linear: true
  group_query_attention: true
  num_query_groups: 2
  attention_dropout: 0.0
  init_method_std: 0.01
  hidden_dropout: 0.0
  adam_beta1: 0.9
  adam_beta2: 0.95
  position_embedding_type: rope
  normalization: RMSNorm
  swiglu: true
  use_flash_attn: true
  attention_softmax_in_fp32: true
"""

JOB_YAML = """\
defaults:
  - model:
      - tiny_qwen

megatron_training:
  model: tiny_qwen
  use_fused_rmsnorm: true
  use_mcore_models: true
  use_flash_attn: true
  bf16: false
  use_distributed_optimizer: true
  tokenizer_type: PretrainedFromHF
  global_batch_size: 4
  seq_length: {seq_length}
  save_interval: 10000
  train_iters: 2
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
  micro_batch_size: 2
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 2
  lr: 1e-4
  lr_decay_style: constant
  min_lr: 0.0
  weight_decay: 0.0
  clip_grad: 1.0
  initial_loss_scale: 4096
  no_load_optim: true
  no_load_rng: true

ref_config:
  model: tiny_qwen
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  micro_batch_size: 4
  no_load_optim: true
  no_load_rng: true

reward_config:
  model: tiny_qwen
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  micro_batch_size: 8

rl_config:
  blocking: true
  experience_count: 4
  gamma: 1.0
  lam: 0.95
  adv_estimator: group_norm
  kl_penalty: kl
  kl_ctrl_type: fixed
  kl_coef: 0.05
  missing_eos_penalty: 0.0
  init_kl_coef: 0.01
  mini_batch_size: 8
  max_prompt_length: 48
  epochs: 1
  clip_ratio: 0.2
  entropy_coeff: 0.001
  shuffle_minibatch: false
  n_samples_per_prompt: 4
  rule_reward: true
  verifier_function: ["integer_answer", "final_answer_format"]
  verifier_weight: [1.0, 0.1]
  colocate_actor_ref: false
  colocate_all_models: false
  num_cpus_for_local_task: 1.0
  actor_resource:
    num_npus: 2
  reference_resource:
    num_npus: 2

generate_config:
  micro_batch_size: 1
  trust_remote_code: true
  infer_tensor_parallel_size: 1
  infer_pipeline_parallel_size: 1
  infer_expert_parallel_size: 1
  max_num_seqs: 16
  max_model_len: 96
  dtype: "float32"
  gpu_memory_utilization: 0.02
  offload_train_optimizer: true
  offload_train_grad: true
  offload_train_param: true
  sampling_config:
    logprobs: 1
    max_tokens: 24
    top_p: 1.0
    top_k: -1
    min_p: 0.0
    temperature: 1.0
    detokenize: false
"""


def test_march_2025_config_with_its_model_yaml_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("msrl_history")
    train, _ = make_arithmetic_problems(32, 0, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    hf = make_tiny_hf_dir("qwen2", root / "qwen2")
    (root / "model").mkdir()
    (root / "model" / "tiny_qwen.yaml").write_text(MODEL_YAML)
    from transformers import AutoTokenizer

    # below the shortest templated prompt, so every prompt is cut to exactly seq_length
    shortest = min(len(p.prompt_ids) for p in load_prompt_dataset(
        str(root / "train.jsonl"), AutoTokenizer.from_pretrained(hf), 48))
    seq_length = shortest - 3
    config = root / "grpo_trainer_tiny_qwen.yaml"
    config.write_text(JOB_YAML.format(seq_length=seq_length))
    assets = {"root": root, "model": root / "model" / "tiny_qwen.yaml",
              "data": root / "train.jsonl"}
    proc, rows = run_job(assets, "march_2025", f"actor_config.load={hf}",
                         f"megatron_training.tokenizer_name_or_path={hf}",
                         launcher="pretrain_grpo.py", config=config, timeout=600)
    out = proc.stdout
    # the plan says how each older key was read
    for line in ("ref_config.tensor_model_parallel_size=2, pipeline_model_parallel_size=1: the "
                 "reference's layout on NPUs of its own",
                 "reference  runs in its own layout: TP 2 x PP 1 x DP 1 over the actor's ranks",
                 "reward_config: not read",
                 "rl_config.mini_batch_size=8: counted responses in MindSpeed-RL before "
                 "2025-05-15",
                 "rl_config.experience_count=4 (an older MindSpeed-RL key",
                 "megatron_training.norm_epsilon=1e-06: translated to the model's norm_epsilon",
                 f"warning: megatron_training.seq_length={seq_length} is shorter than "
                 "rl_config.max_prompt_length=48"):
        assert line in out, line
    train_rows = training_rows(rows)
    assert sorted(train_rows) == [1, 2]
    for row in train_rows.values():
        # 8 responses per step in MindSpeed-RL's units then = 2 prompts: two optimizer steps,
        # so the old log-probs are computed; the reference runs in its own layout (TP 2 x
        # PP 1 beside the actor's TP 1 x PP 2)
        assert "timing/old_log_p" in row and "timing/reference_model" in row
        assert row["prompt_length/mean"] == seq_length     # every prompt cut as MindSpeed-RL
        assert math.isfinite(row["actor/kl_loss"]) and math.isfinite(row["actor/pg_loss"])
