"""DeepSeek-V3 in MindSpeed-RL's config format: its model yaml's keys become transformers'
DeepseekV3Config fields, the 671B job's dry run at 384 ranks, and the refusals that name
the key (pure Python, no torch).

The job is MindSpeed-RL's layout for DeepSeek-R1 671B on 384 NPUs (TP 4 x PP 6 with an
uneven num_layer_list, EP 16 with moe_tp_extend_ep, vLLM TP 2 x EP 64), written here in
its format; the model yaml holds DeepSeek-V3's published sizes under MindSpeed's names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindspeed_rl.config import load_config, main, make_plan
from mindspeed_rl.config.megatron_model_yaml import translate_megatron_model
from mindspeed_rl.config.model_spec import read_model_spec
from mindspeed_rl.config.yaml_source import read_yaml_file
from test_mindspeed_rl_config import error_of  # (tests/ is on sys.path: conftest.py)

MODEL_YAML = """\
deepseekv3_671b:
  use_mcore_models: true
  spec: [mindspeed_llm.tasks.models.spec.deepseek_spec, layer_spec]
  num_layers: 61
  hidden_size: 7168
  ffn_hidden_size: 18432
  num_attention_heads: 128
  padded_vocab_size: 129280
  make_vocab_size_divisible_by: 1
  untie_embeddings_and_output_weights: true
  disable_bias_linear: true
  multi_latent_attention: true
  q_lora_rank: 1536
  kv_lora_rank: 512
  qk_head_dim: 128
  qk_pos_emb_head_dim: 64
  v_head_dim: 128
  qk_layernorm: true
  num_experts: 256
  moe_ffn_hidden_size: 2048
  moe_router_topk: 8
  first_k_dense_replace: 3
  moe_layer_freq: 1
  n_shared_experts: 1
  moe_grouped_gemm: true
  moe_token_dispatcher_type: alltoall_seq
  moe_router_load_balancing_type: seq_aux_loss
  moe_router_num_groups: 8
  moe_router_group_topk: 4
  moe_router_topk_scaling_factor: 2.5
  norm_topk_prob: true
  moe_router_score_function: sigmoid
  moe_router_enable_expert_bias: true
  position_embedding_type: rope
  rotary_base: 10000
  max_position_embeddings: 163840
  rope_scaling_type: yarn
  rope_scaling_factor: 40
  beta_fast: 32
  beta_slow: 1
  rope_scaling_mscale: 1.0
  rope_scaling_mscale_all_dim: 1.0
  rope_scaling_original_max_position_embeddings: 4096
  normalization: RMSNorm
  norm_epsilon: 1e-6
  swiglu: true
"""

JOB_YAML = """\
defaults:
  - model:
      - deepseekv3_671b
megatron_training:
  model: deepseekv3_671b
  tokenizer_name_or_path: ./DeepSeek-V3-hf/
  bf16: true
  use_distributed_optimizer: true
  sequence_parallel: true
  global_batch_size: 384
  seq_length: 1024
  stage: ray_grpo
  data_path: ./deepscaler
  shape_order: BNSD
  swap_optimizer: true
  moe_alltoall_overlap_comm: true
actor_config:
  micro_batch_size: 1
  tensor_model_parallel_size: 4
  pipeline_model_parallel_size: 6
  expert_model_parallel_size: 16
  moe_tp_extend_ep: true
  num_layer_list: 9,10,10,10,11,11
  recompute_granularity: full
  recompute_method: block
  recompute_num_layers: 9
  initial_loss_scale: 4096
  finetune: true
  load: ./ckpt
rl_config:
  use_integrated_worker: true
  use_remove_padding: true
  use_dynamic_bsz: true
  max_packing_token_size: 4096
  mini_batch_size: 384
  max_prompt_length: 1024
  n_samples_per_prompt: 32
  init_kl_coef: 0.001
  verifier_function: [base_acc]
  verifier_weight: [1.0]
  actor_resource:
    num_npus: 384
generate_config:
  infer_tensor_parallel_size: 2
  infer_expert_parallel_size: 64
  enable_expert_parallel: true
  torchair_graph: true
  max_num_seqs: 64
  max_model_len: 3072
  max_num_batched_tokens: 1024
  dtype: bfloat16
  gpu_memory_utilization: 0.75
  offload_train_grad: true
  offload_train_param: true
  sampling_config:
    max_tokens: 2048
"""

# DeepSeek-V3's architecture as its config.json states it (DeepseekV3Config's names).
DEEPSEEK_V3_FIELDS = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
    "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "seq_aux": True, "rope_theta": 10000, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
}
# sum(p.numel()) of transformers' DeepseekV3ForCausalLM with these fields (built on the meta
# device; its MTP layer is not part of it, its expert bias is a buffer)
DEEPSEEK_V3_PARAMETERS = 671_026_404_352


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Write the job (with edits) and the model yaml under tmp_path; cd there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()

    def write(replace: dict[str, str] | None = None, model_replace: dict[str, str] | None = None
              ) -> Path:
        text, model = JOB_YAML, MODEL_YAML
        for old, new in (replace or {}).items():
            assert old in text, old
            text = text.replace(old, new)
        for old, new in (model_replace or {}).items():
            assert old in model, old
            model = model.replace(old, new)
        (tmp_path / "model" / "deepseekv3_671b.yaml").write_text(model)
        path = tmp_path / "grpo_deepseek_r1_671b.yaml"
        path.write_text(text)
        return path

    return write


def test_model_yaml_becomes_deepseek_v3_config_fields(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(MODEL_YAML)
    hf, settings = translate_megatron_model(read_yaml_file(path, "model"), str(path))
    assert hf == DEEPSEEK_V3_FIELDS and settings == {}
    # MindSpeed-RL 2.0.0 to 2.2.0 spelled the same model with other names
    old = MODEL_YAML
    for new_name, old_name in (("multi_latent_attention", "multi_head_latent_attention"),
                               ("qk_head_dim", "qk_nope_head_dim"),
                               ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
                               ("moe_router_num_groups", "n_group"),
                               ("moe_router_group_topk", "topk_group"),
                               ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
                               ("beta_fast", "rope_scaling_beta_fast"),
                               ("beta_slow", "rope_scaling_beta_slow"),
                               ("moe_ffn_hidden_size", "moe_intermediate_size")):
        old = old.replace(f"  {new_name}:", f"  {old_name}:")
    path.write_text(old.replace("seq_aux_loss", "noaux_tc") + "  seq_aux: true\n")
    assert translate_megatron_model(read_yaml_file(path, "model"), str(path))[0] == hf


def test_parameters_count_mla_dense_layers_and_shared_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_FIELDS))
    spec = read_model_spec(tmp_path, True)        # the HF directory reads the same
    assert spec.is_mla and spec.num_experts == 256 and spec.num_moe_layers == 58
    assert spec.rope_scaling.type == "yarn" and spec.rope_scaling.factor == 40
    counts = spec.parameter_counts()
    assert counts["total"] == DEEPSEEK_V3_PARAMETERS
    assert counts["attention"] == 61 * 187_107_328        # q/kv LoRA, their norms, o_proj
    # active per token: 3 dense MLPs, then router + 8 routed + 1 shared expert per layer
    expert = 3 * 7168 * 2048
    assert spec.active_body_parameters() == (counts["attention"] + 3 * 3 * 7168 * 18432
                                             + 58 * (256 * 7168 + 8 * expert + expert))


def test_the_671b_job_passes_the_dry_run_at_384_ranks(job, capsys):
    path = job()
    assert main(["--config", str(path), "--dry-run", "--world-size", "384"]) == 0
    out = capsys.readouterr().out
    plan = make_plan(load_config(path, check_data=False), 384)
    train = plan.to_dict()["layout"]["training"]
    assert (train["tensor_model_parallel_size"], train["pipeline_model_parallel_size"],
            train["data_parallel_size"], train["expert_model_parallel_size"],
            train["expert_data_parallel_size"]) == (4, 6, 16, 64, 1)
    assert plan.model["num_parameters"] == DEEPSEEK_V3_PARAMETERS
    assert ("pipeline stages: 9,10,10,10,11,11 layers (actor_config.num_layer_list), of them "
            "MoE layers: 6,10,10,10,11,11") in out
    assert "EP 64 = expert_model_parallel_size 16 x TP 4 (moe_tp_extend_ep" in out
    assert "4 per rank, expert-DP 1" in out
    assert ("experts (vLLM): EP 128 = generate_config.infer_tensor_parallel_size 2 x "
            "infer_expert_parallel_size 64: 2 per rank") in out
    assert plan.infer_expert_parallel_size == 128
    # the last stage (11 MoE layers + output layer) on one rank: per layer the MLA share of
    # TP 4 (46,778,368), two norms, router, a quarter of the shared expert and 4 experts
    layer = 46_778_368 + 2 * 7168 + 256 * 7168 + 3 * 7168 * 2048 // 4
    experts = 4 * 3 * 7168 * 2048
    p = plan.parameters
    assert p["training_dense_per_rank"] == 11 * layer + 129280 // 4 * 7168 + 7168
    assert p["training_expert_per_rank"] == 11 * experts
    # vLLM caches MLA's latent (512 + 64) whole on each rank, not per KV head
    assert plan.memory_bytes["kv_cache"] == 64 * 3072 * 61 * 576 * 2
    notices = "\n".join(plan.notices)
    for key in ("megatron_training.shape_order='BNSD'", "megatron_training.swap_optimizer=true",
                "megatron_training.moe_alltoall_overlap_comm=true",
                "actor_config.initial_loss_scale=4096", "generate_config.torchair_graph=true"):
        assert key in notices, key


@pytest.mark.parametrize("edit, key", [
    # MLA: the heads, and the down projections megatron-core splits over TP
    ({"tensor_model_parallel_size: 4": "tensor_model_parallel_size: 3"},
     "actor_config.tensor_model_parallel_size=3 does not divide the model's "
     "num_attention_heads=128"),
    ({"model": {"q_lora_rank: 1536": "q_lora_rank: 1530"}},
     "actor_config.tensor_model_parallel_size=4: does not divide the model's q_lora_rank=1530"),
    ({"model": {"kv_lora_rank: 512": "kv_lora_rank: 510"}},
     "actor_config.tensor_model_parallel_size=4: does not divide the model's kv_lora_rank + "
     "qk_rope_head_dim=574"),
    # uneven pipeline stages
    ({"num_layer_list: 9,10,10,10,11,11": "num_layer_list: 9,10,10,10,11,12"},
     "actor_config.num_layer_list='9,10,10,10,11,12': adds up to 62 layers but the model has "
     "num_layers=61"),
    ({"num_layer_list: 9,10,10,10,11,11": "num_layer_list: 19,10,10,11,11"},
     "actor_config.num_layer_list='19,10,10,11,11': names 5 stages but "
     "pipeline_model_parallel_size=6"),
    # group-limited routing and the experts' split
    ({"model": {"moe_router_group_topk: 4": "moe_router_group_topk: 9"}},
     "deepseekv3_671b.moe_router_group_topk=9: a token routes to more groups than there are: "
     "deepseekv3_671b.moe_router_num_groups=8"),
    ({"model": {"moe_router_num_groups: 8": "moe_router_num_groups: 6"}},
     "deepseekv3_671b.moe_router_num_groups=6: does not divide the 256 routed experts"),
    ({"model": {"moe_router_topk: 8": "moe_router_topk: 4"}},
     "deepseekv3_671b.moe_router_topk=4: megatron-core scores a group by its top"),
    ({"model": {"norm_topk_prob: true": "norm_topk_prob: false"}},
     "deepseekv3_671b.norm_topk_prob=false: megatron-core's sigmoid router renormalises"),
    ({"expert_model_parallel_size: 16": "expert_model_parallel_size: 24"},
     "actor_config.expert_model_parallel_size=96 does not divide the model's num_experts=256"),
    ({"infer_expert_parallel_size: 64": "infer_expert_parallel_size: 96"},
     "generate_config.infer_expert_parallel_size=96: vLLM's expert-parallel size "
     "infer_tensor_parallel_size=2 x 96 = 192 does not divide the model's num_experts=256"),
    # what this family does not build, by name
    ({"model": {"moe_router_enable_expert_bias: true": "moe_router_enable_expert_bias: false"}},
     "deepseekv3_671b.moe_router_enable_expert_bias=false: DeepSeek-V3's router is built here "
     "with its expert bias"),
    ({"model": {"rope_scaling_type: yarn": "rope_scaling_type: llama3"}},
     "deepseekv3_671b.rope_scaling_type='llama3': RoPE scaling other than YaRN"),
    ({"tensor_model_parallel_size: 4\n": "tensor_model_parallel_size: 4\n  "
      "lora_target_modules: [linear_proj]\n"},
     "actor_config.lora_target_modules=['linear_proj']: LoRA is not built here for "
     "multi-latent attention"),
])
def test_the_dry_run_refuses_a_bad_deepseek_v3_layout_by_name(job, capsys, edit, key):
    edit = dict(edit)
    model_edit = edit.pop("model", None)
    path = job(replace=edit, model_replace=model_edit)
    assert main(["--config", str(path), "--dry-run", "--world-size", "384"]) == 2
    err = capsys.readouterr().err
    assert key in err, err


def test_the_training_models_keep_the_per_sequence_balancing_loss(job):
    """DeepSeek-V3's balancing loss is per sequence (seq_aux): with a weight the training
    models get megatron's seq_aux_loss, not the batch-level aux_loss of Qwen3-MoE."""
    from mindspeed_rl.models.training_options import training_model_options

    config = load_config(job(), ["actor_config.moe_aux_loss_coeff=0.001"], check_data=False)
    options = training_model_options(config)
    assert (options["moe_router_load_balancing_type"], options["moe_aux_loss_coeff"]) == (
        "seq_aux_loss", 0.001)
    off = training_model_options(load_config(job(), ["actor_config.moe_aux_loss_coeff=0"],
                                             check_data=False))
    assert off["moe_router_load_balancing_type"] == "none"
