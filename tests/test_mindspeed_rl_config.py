"""MindSpeed-RL's config format: every kind of key, model yamls, and its bad-input cases.

The configs here are written for these tests in MindSpeed-RL's layout (hydra
``defaults:``, Megatron keys in megatron_training or actor_config, a model yaml with
Megatron names nested under the model name); pure Python, no torch.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, load_config, main, make_plan
from mindspeed_rl.config.config_error import ConfigErrors
from mindspeed_rl.config.mindspeed_keys import (HONOURED, NOT_APPLICABLE, ROWS, TRANSLATED,
                                                typo_hint)
from mindspeed_rl.config.normalise import _fields

REPO = Path(__file__).resolve().parents[1]

# A small Qwen3-MoE in MindSpeed-RL's model-yaml form (Megatron names under the model name).
MODEL_YAML = """\
tiny_moe:
  use_mcore_models: true
  spec: [mindspeed_llm.tasks.models.spec.qwen3_spec, layer_spec]
  num_layers: 7
  hidden_size: 256
  ffn_hidden_size: 512
  num_attention_heads: 8
  group_query_attention: true
  num_query_groups: 4
  kv_channels: 32
  qk_layernorm: true
  untie_embeddings_and_output_weights: true
  disable_bias_linear: true
  num_experts: 16
  moe_router_topk: 2
  moe_ffn_hidden_size: 128
  moe_grouped_gemm: true
  moe_token_dispatcher_type: alltoall_seq
  moe_router_load_balancing_type: aux_loss
  moe_aux_loss_coeff: 0.001
  norm_topk_prob: true
  position_embedding_type: rope
  rotary_base: 1000000
  max_position_embeddings: 4096
  padded_vocab_size: 1024
  make_vocab_size_divisible_by: 1
  normalization: RMSNorm
  norm_epsilon: 1e-6
  swiglu: true
"""

# Every kind of key: honoured (same name, in either Megatron section), translated
# (defaults, noop_layers/num_layers, moe_tp_extend_ep), not applicable (kernels, Ray, stage,
# dispatch sizes, DAPO/PPO switches off).
JOB_YAML = """\
defaults:
  - model:
      - tiny_moe

megatron_training:
  model: tiny_moe
  use_fused_rmsnorm: true
  use_mcore_models: true
  sequence_parallel: true
  use_flash_attn: true
  attention_softmax_in_fp32: true
  bf16: true
  use_distributed_optimizer: true
  tokenizer_type: PretrainedFromHF
  tokenizer_name_or_path: ./tiny-moe-hf
  global_batch_size: 16
  seq_length: 512
  save_interval: 10
  train_iters: 20
  stage: ray_grpo
  attention_dropout: 0.0
  hidden_dropout: 0.0
  init_method_std: 0.01
  distributed_backend: nccl
  no_shared_storage: true
  dataset_additional_keys: ['labels']
  data_path: ./dataset/data
  split: 100,0,0
  seed: 1
  recompute_granularity: full
  recompute_method: block
  recompute_num_layers: 1

actor_config:
  model: tiny_moe
  micro_batch_size: 2
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 2
  expert_model_parallel_size: 2
  moe_tp_extend_ep: true
  noop_layers: "3"
  num_layers: 8
  lr: 1e-6
  lr_decay_style: constant
  min_lr: 0
  weight_decay: 0.01
  clip_grad: 1.0
  finetune: true
  load: ./ckpt
  save: ./ckpt
  no_load_optim: true
  no_load_rng: true

rl_config:
  use_integrated_worker: true
  blocking: true
  gamma: 1.0
  lam: 0.95
  actor_forward_micro_batch_size: 4
  ref_forward_micro_batch_size: 4
  actor_update_dispatch_size: 1024
  reward_dispatch_size: 64
  use_remove_padding: true
  adv_estimator: group_norm
  kl_penalty: kl
  kl_ctrl_type: fixed
  init_kl_coef: 0.001
  mini_batch_size: 8
  max_prompt_length: 256
  epochs: 1
  clip_ratio: 0.2
  entropy_coeff: 0.0
  shuffle_mini_batch: false
  n_samples_per_prompt: 4
  rule_reward: true
  verifier_function: ["acc_for_dapo", "format"]
  verifier_weight: [1.0, 0.1]
  clip_higher_enable: false
  clip_ratio_low: 0.2
  actor_resource:
    num_npus: 8

generate_config:
  trust_remote_code: true
  offload_train_optimizer: true
  offload_train_grad: true
  offload_train_param: true
  infer_tensor_parallel_size: 2
  infer_pipeline_parallel_size: 1
  infer_expert_parallel_size: 2
  enable_expert_parallel: true
  enable_prefix_caching: true
  num_scheduler_steps: 1
  max_num_seqs: 32
  max_model_len: 1024
  max_num_batched_tokens: 2048
  dtype: "bfloat16"
  gpu_memory_utilization: 0.6
  sampling_config:
    logprobs: 1
    max_tokens: 512
    top_p: 1.0
    top_k: -1
    min_p: 0
    temperature: 1.0
    detokenize: false
"""


@pytest.fixture
def msrl(tmp_path, monkeypatch):
    """Write the MindSpeed-RL-format job (with edits) under tmp_path/configs; cd tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "tiny_moe.yaml").write_text(MODEL_YAML)

    def write(text: str = JOB_YAML, *, replace: dict[str, str] | None = None) -> Path:
        for old, new in (replace or {}).items():
            assert old in text, old
            text = text.replace(old, new)
        path = tmp_path / "configs" / "grpo_tiny_moe.yaml"
        path.write_text(text)
        return path

    return write


def error_of(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


def test_mindspeed_rl_config_with_every_key_kind_passes_the_dry_run(msrl, capsys):
    path = msrl()
    assert main(["--config", str(path), "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "dry-run OK" in out
    config = load_config(path, check_data=False)
    m, a, rl, g = config.model, config.actor_config, config.rl_config, config.generate_config
    # the model yaml: Megatron names -> the architecture
    assert (m.model_type, m.num_hidden_layers, m.num_kv_heads, m.head_dim, m.vocab_size,
            m.num_experts, m.moe_intermediate_size, m.tie_word_embeddings) == (
        "qwen3_moe", 7, 4, 32, 1024, 16, 128, False)
    # honoured, from either Megatron section; the model yaml's training key
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == (
        "full", "block", 1)
    assert config.megatron_training.seq_length == 512 and a.finetune and a.moe_aux_loss_coeff == 0.001
    assert rl.kl_penalty == "kl" and rl.verifier_function == ("acc_for_dapo", "format")
    assert g.enable_expert_parallel and g.infer_expert_parallel_size == 2
    # translated: 8 padded layers over 2 stages, layer 3 an identity -> 3 + 4 real layers
    assert a.num_layer_list == "3,4"
    assert (a.expert_tensor_parallel_size, a.expert_model_parallel_size) == (1, 4)
    plan = make_plan(config, 8)
    train = plan.to_dict()["layout"]["training"]
    assert (train["tensor_model_parallel_size"], train["pipeline_model_parallel_size"],
            train["data_parallel_size"], train["expert_model_parallel_size"]) == (2, 2, 2, 4)
    assert plan.infer_expert_parallel_size == 4          # vLLM EP = TP_g 2 x 2 replicas
    # not applicable: one notice block, each with its reason
    notices = "\n".join(plan.notices)
    for key in ("megatron_training.use_flash_attn=true", "megatron_training.stage='ray_grpo'",
                "rl_config.actor_update_dispatch_size=1024", "rl_config.blocking=true",
                "rl_config.actor_resource={'num_npus': 8}",
                "generate_config.sampling_config.detokenize=false"):
        assert key in notices, key
    assert "translated to actor_config.num_layer_list='3,4'" in notices
    assert "MindSpeed-RL keys translated, or accepted without effect here" in out
    assert "initial weights" in out and "actor_config.load=" in out


def test_three_misspelled_keys_are_one_error(msrl):
    path = msrl(replace={"  micro_batch_size: 2\n": "  micro_batch_sise: 2\n",
                         "  epochs: 1\n": "  epoch: 1\n",
                         "  max_num_seqs: 32\n": "  max_num_seq: 32\n"})
    error = error_of(load_config, path, check_data=False)
    assert isinstance(error, ConfigErrors) and len(error.errors) == 3
    text = str(error)
    assert text.startswith("3 problems in grpo_tiny_moe.yaml:")
    assert "actor_config.micro_batch_sise: unknown key; did you mean actor_config.micro_batch_size?" in text
    assert "rl_config.epoch: unknown key; did you mean rl_config.epochs?" in text
    assert "generate_config.max_num_seq: unknown key; did you mean generate_config.max_num_seqs?" in text


def test_values_this_project_cannot_honour_are_one_error(msrl):
    path = msrl(replace={"  infer_pipeline_parallel_size: 1\n": "  infer_pipeline_parallel_size: 2\n",
                         "  seed: 1\n": "  seed: 1\n  num_layers_per_virtual_pipeline_stage: 2\n",
                         "  clip_higher_enable: false\n":
                             "  clip_higher_enable: false\n  is_multimodal: true\n",
                         "  stage: ray_grpo\n": "  stage: ray_ppo\n"})
    error = error_of(load_config, path, check_data=False)
    text = str(error)
    assert text.startswith("4 problems in grpo_tiny_moe.yaml:"), text
    for key in ("generate_config.infer_pipeline_parallel_size=2",
                "megatron_training.num_layers_per_virtual_pipeline_stage=2",
                "rl_config.is_multimodal=true", "megatron_training.stage='ray_ppo'"):
        assert key + ": cannot be honoured here" in text, key


def test_unknown_verifiers_fail_in_the_dry_run(msrl, capsys):
    path = msrl(replace={'verifier_function: ["acc_for_dapo", "format"]':
                         'verifier_function: ["acc_for_dapo2", "math17k_acc"]'})
    assert main(["--config", str(path), "--dry-run", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rl_config.verifier_function=['acc_for_dapo2', 'math17k_acc']: "
                          "unknown verifier(s) ['acc_for_dapo2', 'math17k_acc']")
    assert "'acc_for_dapo'" in err and "'math_17k_acc'" in err   # the registered names listed


def test_hints_only_name_keys_that_mean_the_same():
    # a dispatch chunk size is not a forward micro-batch size: no hint between them
    assert typo_hint("actor_update_dispatch_size", ["actor_forward_micro_batch_size"]) is None
    assert typo_hint("n_sample_per_prompt", ["n_samples_per_prompt"]) == (
        "did you mean n_samples_per_prompt?")


def test_mindspeed_rl_keys_are_accepted_not_misread(msrl):
    """actor_update_dispatch_size is MindSpeed-RL's and changes nothing here: accepted with a
    notice, never suggested as (or turned into) a forward micro-batch size."""
    config = load_config(msrl(), check_data=False)
    assert config.rl_config.actor_forward_micro_batch_size == 4
    assert any(n.startswith("rl_config.actor_update_dispatch_size=1024") for n in config.notices)


def test_defaults_model_must_exist(msrl):
    path = msrl(replace={"      - tiny_moe\n": "      - other_moe\n"})
    error = error_of(load_config, path, check_data=False)
    assert "megatron_training.model='tiny_moe': is not one of the defaults models" in str(error)


def test_model_yaml_with_unsupported_architecture(msrl, tmp_path):
    path = msrl()
    model = tmp_path / "configs" / "model" / "tiny_moe.yaml"
    # DeepSeek-V3's keys without multi-latent attention, and Llama-3 RoPE scaling
    model.write_text(MODEL_YAML.replace("  swiglu: true\n", "  swiglu: true\n"
                                        "  n_shared_experts: 1\n  low_freq_factor: 1.0\n"))
    text = str(error_of(load_config, path, check_data=False))
    assert "2 problems" in text, text
    assert "tiny_moe.n_shared_experts=1: is an architecture not built here" in text
    assert "DeepSeek-V3's keys need multi_latent_attention: true" in text
    assert "tiny_moe.low_freq_factor=1.0: is an architecture not built here" in text
    # multi-latent attention on a Qwen3-MoE body: DeepSeek-V3's keys it lacks, by name
    model.write_text(MODEL_YAML.replace("  swiglu: true\n", "  swiglu: true\n"
                                        "  multi_latent_attention: true\n"))
    text = str(error_of(load_config, path, check_data=False))
    for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                "moe_router_score_function", "moe_router_enable_expert_bias"):
        assert f"tiny_moe.{key}" in text, key


def test_noop_layers_must_fit_the_model(msrl):
    path = msrl(replace={"  num_layers: 8\n": "  num_layers: 10\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("actor_config.num_layer_list='4,5': adds up to 9 layers but the "
                           "model has num_layers=7")


def test_recompute_and_stage_checks(msrl):
    text = str(error_of(load_config, msrl(replace={"  recompute_num_layers: 1\n":
                                                   "  recompute_num_layers: 5\n"}),
                        check_data=False))
    assert text.startswith("actor_config.recompute_num_layers=5: exceeds the 4 layers")
    text = str(error_of(load_config, msrl(replace={"  recompute_method: block\n": ""}),
                        check_data=False))
    assert text.startswith("actor_config.recompute_method=null: recompute_granularity full")


def test_vllm_expert_parallel_needs_divisible_experts(msrl):
    config = load_config(msrl(replace={"  infer_expert_parallel_size: 2\n":
                                       "  infer_expert_parallel_size: 4\n",
                                       "  infer_tensor_parallel_size: 2\n":
                                       "  infer_tensor_parallel_size: 8\n"}), check_data=False)
    text = str(error_of(make_plan, config, 32))
    assert "vLLM's expert-parallel size infer_tensor_parallel_size=8 x 4 = 32 does not divide" \
        in text


def test_reference_section_reads_only_load(msrl):
    path = msrl(JOB_YAML + "ref_config:\n  load: ./ref_ckpt\n")
    config = load_config(path, check_data=False)
    assert config.ref_config.load == str(Path("ref_ckpt").absolute())
    path = msrl(JOB_YAML + "ref_config:\n  load: ./ref_ckpt\n  tensor_model_parallel_size: 4\n")
    assert "only ref_config.load is read" in str(error_of(load_config, path, check_data=False))


def test_hyphenated_keys_are_read_as_their_underscore_names(msrl, tmp_path):
    """MindSpeed-RL's config classes read '-' in a key as '_' (its DPO config writes
    ``min-lr: 0``), in every section they read and in the model yaml; so do overrides."""
    model = tmp_path / "configs" / "model" / "tiny_moe.yaml"
    model.write_text(MODEL_YAML.replace("  norm_epsilon: 1e-6\n", "  norm-epsilon: 1e-6\n"))
    path = msrl(replace={"  min_lr: 0\n": "  min-lr: 1.0e-7\n",
                         "  seq_length: 512\n": "  seq-length: 384\n",
                         "  use_flash_attn: true\n": "  use-flash-attn: true\n",
                         "  max_prompt_length: 256\n": "  max-prompt-length: 200\n",
                         "  max_num_seqs: 32\n": "  max-num-seqs: 24\n"})
    config = load_config(path, ["actor_config.clip-grad=0.5"], check_data=False)
    assert config.actor_config.min_lr == 1e-7 and config.megatron_training.seq_length == 384
    assert config.rl_config.max_prompt_length == 200
    assert config.generate_config.max_num_seqs == 24
    assert config.actor_config.clip_grad == 0.5
    assert config.model.rms_norm_eps == 1e-6
    notices = "\n".join(config.notices)
    assert ("actor_config.min-lr=1e-07: read as actor_config.min_lr (MindSpeed-RL reads '-' in "
            "a key as '_', as Megatron's argument parser does)") in notices
    assert "tiny_moe.norm-epsilon=1e-06: read as tiny_moe.norm_epsilon" in notices
    # a key without effect here is named as written
    assert "megatron_training.use-flash-attn=true: an Ascend/CUDA kernel" in notices
    assert make_plan(config, 8)
    # an unknown key is named as written
    text = str(error_of(load_config, msrl(replace={"  seed: 1\n": "  seed: 1\n  no-such-key: 1\n"}),
                        check_data=False))
    assert text.startswith("megatron_training.no-such-key: unknown key")
    assert "has no_such_key in megatron_training" in text


def test_both_spellings_of_a_key_must_agree(msrl):
    path = msrl(replace={"  min_lr: 0\n": "  min_lr: 0\n  min-lr: 1.0e-7\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text == ("actor_config.min-lr=1e-07: actor_config.min_lr=0 is the same key "
                    "(MindSpeed-RL reads '-' in a key as '_') with another value; keep one of "
                    "them"), text
    config = load_config(msrl(replace={"  min_lr: 0\n": "  min_lr: 0\n  min-lr: 0\n"}),
                         check_data=False)
    assert config.actor_config.min_lr == 0


def test_qk_layernorm_in_the_job_must_agree_with_the_model(msrl):
    """MindSpeed-RL's DPO config writes ``qk_layernorm: true`` in megatron_training; the
    model's file decides (Qwen3-MoE has q/k norms)."""
    path = msrl(replace={"  seed: 1\n": "  seed: 1\n  qk_layernorm: true\n"})
    config = load_config(path, check_data=False)
    assert ("megatron_training.qk_layernorm=true: the model (qwen3_moe, in tiny_moe.yaml) has "
            "q/k norms: the same") in config.notices
    path = msrl(replace={"  seed: 1\n": "  seed: 1\n  qk_layernorm: false\n"})
    text = str(error_of(load_config, path, check_data=False))
    assert text.startswith("megatron_training.qk_layernorm=false: the model (qwen3_moe, in "
                           "tiny_moe.yaml) has q/k norms: the architecture has one source here"), text
    assert "remove the key (the model's file decides" in text


def test_key_table_is_consistent_with_the_schema_and_the_docs():
    docs = (REPO / "docs" / "config.md").read_text()
    seen = set()
    for r in ROWS:
        assert (r.family, r.name) not in seen, r.name
        seen.add((r.family, r.name))
        assert r.handling in (HONOURED, TRANSLATED, NOT_APPLICABLE)
        if r.handling == HONOURED:
            section, key = r.detail.rsplit(".", 1)
            assert key in _fields(section), r.detail
        assert f"`{r.name}`" in docs, f"{r.name} is not in docs/config.md"
