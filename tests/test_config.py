"""Job configuration: loading, overrides, error messages and the dry-run plan (pure Python)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mindspeed_rl.config import (
    ConfigError,
    ModelSpec,
    load_config,
    main,
    make_plan,
    params_per_rank,
    parse_launcher_args,
    parse_override,
)
from mindspeed_rl.config.typed_sections import build_section

REPO = Path(__file__).resolve().parents[1]
CONFIG_7B = REPO / "configs" / "grpo_qwen25_7b.yaml"
CONFIG_32B = REPO / "configs" / "grpo_qwen25_32b.yaml"
GIB = 1024 ** 3

# A Qwen2-style toy: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, vocab 256.
TINY_MODEL = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Write a tiny job (model yaml + data file + config) in tmp_path, cd there; return a
    function that writes the config with section updates and returns its path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text(yaml.safe_dump(TINY_MODEL))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')

    def write(**updates) -> Path:
        config = {
            "megatron_training": {"model": "model/tiny.yaml", "tokenizer_name_or_path": "./tok",
                                  "data_path": "train.jsonl", "global_batch_size": 4},
            "actor_config": {"tensor_model_parallel_size": 2},
            "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 2},
            "generate_config": {"infer_tensor_parallel_size": 2,
                                "sampling_config": {"max_tokens": 64}},
        }
        for section, values in updates.items():
            if values is None:
                config.pop(section)
            else:
                config.setdefault(section, {}).update(values)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ---- the real configs ---------------------------------------------------------------------

@pytest.mark.parametrize("path, world, tp, pp, dp, tpg, dpg", [
    (CONFIG_7B, 16, 4, 1, 4, 4, 4),
    (CONFIG_32B, 32, 8, 2, 2, 8, 4),
])
def test_real_configs_dry_run(path, world, tp, pp, dp, tpg, dpg, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(path, check_data=False)
    assert config.megatron_training.bf16 and config.megatron_training.use_distributed_optimizer
    assert config.actor_config.lr == 1e-6          # "1e-6" is a float, not YAML 1.1's string
    assert config.rl_config.n_samples_per_prompt == 8
    plan = make_plan(config, world).to_dict()
    train, gen = plan["layout"]["training"], plan["layout"]["generation"]
    assert (train["tensor_model_parallel_size"], train["pipeline_model_parallel_size"],
            train["data_parallel_size"]) == (tp, pp, dp)
    assert (gen["infer_tensor_parallel_size"], gen["data_parallel_size"]) == (tpg, dpg)
    s = plan["samples"]
    gbs, n = config.megatron_training.global_batch_size, 8
    assert s["responses_per_iteration"] == gbs * n
    assert s["prompts_per_generation_dp_rank"] * dpg == gbs
    assert s["responses_per_training_dp_rank"] * dp == gbs * n
    assert s["micro_batches_per_mini_batch"] == config.rl_config.mini_batch_size * n // dp
    # plausible for a 64 GB device: each phase well under it, none empty
    for key, value in plan["phase_bytes"].items():
        if key != "device_memory_for_vllm":
            assert 4 * GIB < value < 48 * GIB, key


def test_real_configs_fail_at_wrong_world_size(monkeypatch):
    monkeypatch.chdir(REPO)
    message = error_of(make_plan, load_config(CONFIG_7B, check_data=False), 12)
    assert "megatron_training.global_batch_size=64" in message
    assert "generation data-parallel size 3" in message
    assert "world sizes this config accepts: 4, 8, 16, 32" in message
    message = error_of(make_plan, load_config(CONFIG_32B, check_data=False), 12)
    assert "actor_config.tensor_model_parallel_size=8" in message
    assert "actor_config.pipeline_model_parallel_size=2" in message
    assert "16, 32" in message


def test_module_entry_point_prints_plan_and_errors(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["--config", "configs/grpo_qwen25_7b.yaml", "--dry-run", "--world-size", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dry-run OK" in out and "7,615,616,512 parameters" in out and "KV cache" in out
    assert main(argv + ["rl_config.n_sample_per_prompt=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: rl_config.n_sample_per_prompt")
    assert main(["--config", "configs/grpo_qwen25_32b.yaml", "--dry-run",
                 "--world-size", "12"]) == 2


# ---- parameter counts and memory ----------------------------------------------------------

def test_parameter_counts_of_qwen25(monkeypatch):
    monkeypatch.chdir(REPO)
    assert load_config(CONFIG_7B, check_data=False).model.num_parameters() == 7_615_616_512
    assert load_config(CONFIG_32B, check_data=False).model.num_parameters() == 32_763_876_352


@pytest.mark.parametrize("fields, total", [
    # sum(p.numel()) of transformers 5.19 models built from these configs on the meta device
    (dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=48,
          num_experts=8, num_experts_per_tok=2, vocab_size=1000, tie_word_embeddings=False),
     425_088),
    (dict(model_type="qwen3", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, head_dim=32, intermediate_size=96, vocab_size=1000,
          tie_word_embeddings=True), 193_664),
    (dict(model_type="llama", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, intermediate_size=96, vocab_size=1000,
          tie_word_embeddings=True), 156_608),
    (dict(model_type="qwen2_moe", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
          num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=48,
          shared_expert_intermediate_size=80, num_experts=8, num_experts_per_tok=2,
          vocab_size=1000, tie_word_embeddings=False), 434_688),
])
def test_parameter_counts_match_transformers(fields, total):
    spec = build_section(ModelSpec, fields, "model", given={"source": "test"})
    assert spec.num_parameters() == total


def test_memory_per_rank_by_hand(job):
    config = load_config(job(megatron_training={"bf16": True, "use_distributed_optimizer": True}))
    plan = make_plan(config, 4).to_dict()        # train TP=2 DP=2; generate TP=2 DP=2
    # Per TP rank of TINY_MODEL (h=64, 4 heads/2 KV heads of 16, TP=2: 2 q heads, 1 KV head):
    #   attention: q 64*32 + k 64*16 + v 64*16 + o 32*64 = 6144, qkv bias 32+16+16 = 64
    #   mlp: 3*64*128/2 = 12288; norms 2*64 = 128        -> layer 18624, x2 layers = 37248
    #   embedding 256/2*64 = 8192, untied lm_head 8192, final norm 64
    per_rank = 37248 + 8192 + 8192 + 64
    assert per_rank == 53696
    assert plan["parameters"]["training_per_rank"] == per_rank
    assert plan["parameters"]["generation_per_rank"] == per_rank
    mem = plan["memory_bytes"]
    assert mem["actor_params"] == per_rank * 2                    # bf16
    assert mem["actor_grads"] == per_rank * 4                     # fp32 main grads
    assert mem["actor_optimizer"] == per_rank * 12 // 2           # master + m + v, / DP 2
    assert mem["reference_params"] == per_rank * 2
    assert mem["vllm_weights"] == per_rank * 2                    # dtype auto -> bf16
    # KV: 64 seqs x 512 tokens x 2 layers x (k, v) x 1 KV head x 16 dims x 2 bytes
    assert mem["kv_cache"] == 64 * 512 * 2 * 2 * 1 * 16 * 2
    assert plan["phase_bytes"]["training_phase"] == per_rank * (2 + 4 + 6)

    fp32 = make_plan(load_config(job(megatron_training={"bf16": False})), 4).to_dict()
    assert fp32["memory_bytes"]["actor_optimizer"] == per_rank * 8   # m + v, replicated


def test_pipeline_heaviest_stage():
    spec = build_section(ModelSpec, TINY_MODEL, "model", given={"source": "test"})
    dense, expert = params_per_rank(spec, tp=1, pp=2)
    layer = (64 * 64 * 2 + 64 * 32 * 2) + (64 + 32 + 32) + 3 * 64 * 128 + 2 * 64
    assert (dense, expert) == (layer + 256 * 64 + 64, 0)   # last stage: layer + norm + lm_head


# ---- loading, paths, overrides ------------------------------------------------------------

def test_defaults_and_relative_paths(job, tmp_path):
    config = load_config(job())
    mt = config.megatron_training
    assert mt.data_path == str(tmp_path / "train.jsonl")
    assert mt.model == str(tmp_path / "model" / "tiny.yaml")
    assert mt.tokenizer_name_or_path == str(tmp_path / "tok")
    assert mt.log_dir == str(tmp_path / "logs")
    assert mt.prompt_key == "prompt" and mt.answer_key == "answer"
    assert config.sampling_config.stop_token_ids == ()


def test_mini_batch_defaults_to_global_batch(job):
    config = load_config(job(rl_config={"mini_batch_size": None}))
    assert config.rl_config.mini_batch_size == config.megatron_training.global_batch_size


def test_hf_directory_model(job, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**TINY_MODEL, "torch_dtype": "bfloat16",
                                                "bos_token_id": 1}))
    config = load_config(job(megatron_training={"model": "hf", "tokenizer_name_or_path": None}))
    assert config.model.hf_dir == str(hf)
    assert config.megatron_training.tokenizer_name_or_path == str(hf)   # defaults to the HF dir
    assert config.model.num_kv_heads == 2


def test_hf_directory_without_config_json(job, tmp_path):
    (tmp_path / "empty_hf").mkdir()
    message = error_of(load_config, job(megatron_training={"model": "empty_hf"}))
    assert message.startswith("megatron_training.model=")
    assert "has no config.json" in message


def test_bare_model_name_found_next_to_config(monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(CONFIG_7B, ["megatron_training.model=qwen25_32b"], check_data=False)
    assert config.model.num_hidden_layers == 64


@pytest.mark.parametrize("text, value", [
    ("rl_config.n_samples_per_prompt=8", 8),
    ("actor_config.lr=1e-6", 1e-6),
    ("actor_config.lr=2.5E-5", 2.5e-5),
    ("megatron_training.bf16=true", True),
    ("megatron_training.bf16=false", False),
    ("rl_config.verifier_function=[math_answer,format]", ["math_answer", "format"]),
    ("generate_config.sampling_config.stop_token_ids=[1, 2]", [1, 2]),
    ("actor_config.save=./ckpt/out", "./ckpt/out"),
    ("megatron_training.test_data_path=null", None),
])
def test_parse_override(text, value):
    key, parsed = parse_override(text)
    assert key == text.split("=")[0] and parsed == value and type(parsed) is type(value)


def test_overrides_apply(job):
    config = load_config(job(), [
        "rl_config.n_samples_per_prompt=8", "actor_config.lr=1e-6", "megatron_training.bf16=true",
        "rl_config.verifier_function=[math_answer,format]", "rl_config.verifier_weight=[1, 0.5]",
        "generate_config.sampling_config.temperature=0.7",
    ])
    assert config.rl_config.n_samples_per_prompt == 8
    assert isinstance(config.actor_config.lr, float) and config.actor_config.lr == 1e-6
    assert config.megatron_training.bf16 is True
    assert config.rl_config.verifier_function == ("math_answer", "format")
    assert config.rl_config.verifier_weight == (1.0, 0.5)
    assert config.sampling_config.temperature == 0.7


def test_effective_config_round_trips(job, tmp_path):
    config = load_config(job(), ["rl_config.verifier_function=[math_answer,step]",
                                 "rl_config.verifier_weight=[1,2]"])
    dumped = tmp_path / "effective.yaml"
    dumped.write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(dumped) == config.__class__(**{**config.__dict__,
                                                      "config_path": str(dumped)})


def test_launcher_args():
    args = parse_launcher_args(["rl_config.epochs=2", "--config", "c.yaml", "--dry-run",
                                "--world-size", "16", "actor_config.lr=1e-6"])
    assert (args.config, args.dry_run, args.world_size) == ("c.yaml", True, 16)
    assert args.overrides == ("rl_config.epochs=2", "actor_config.lr=1e-6")
    assert "--world-size" in error_of(parse_launcher_args, ["--config", "c.yaml", "--dry-run"])
    assert "dotted.key=value" in error_of(parse_launcher_args, ["--config", "c.yaml", "epochs"])
    assert "--config" in error_of(parse_launcher_args, [])


# ---- error messages -----------------------------------------------------------------------

def test_misspelled_key_in_file(job):
    message = error_of(load_config, job(rl_config={"n_sample_per_prompt": 8}))
    assert message == ("rl_config.n_sample_per_prompt: unknown key; did you mean "
                       "rl_config.n_samples_per_prompt?")


def test_key_in_wrong_section(job):
    message = error_of(load_config, job(generate_config={"n_samples_per_prompt": 2}))
    assert message == ("generate_config.n_samples_per_prompt: unknown key; it belongs in another "
                       "section: did you mean rl_config.n_samples_per_prompt?")


def test_megatron_keys_in_either_megatron_section(job):
    """MindSpeed-RL merges megatron_training into actor_config: a Megatron key may sit in
    either, and actor_config wins."""
    config = load_config(job(megatron_training={"tensor_model_parallel_size": 4, "lr": 1e-5,
                                                "no_load_optim": True},
                             actor_config={"seed": 7, "lr": 2e-5}))
    assert config.actor_config.tensor_model_parallel_size == 2   # actor_config's own value
    assert config.actor_config.lr == 2e-5 and config.actor_config.no_load_optim
    assert config.megatron_training.seed == 7


def test_unknown_section(job, tmp_path):
    path = job()
    path.write_text(path.read_text() + "rl_cofig:\n  epochs: 1\n")
    assert "did you mean rl_config?" in error_of(load_config, path)


def test_duplicate_key(job, tmp_path):
    path = job()
    path.write_text(path.read_text() + "rl_config:\n  epochs: 2\n")
    assert "'rl_config' is written twice" in error_of(load_config, path)


def test_non_utf8_yaml_names_the_file_and_the_byte(job):
    path = job()
    text = path.read_bytes()
    offset = text.index(b"rl_config")
    path.write_bytes(text[:offset] + b"# caf\xe9 (Latin-1)\n" + text[offset:])
    message = error_of(load_config, path)
    line = text[:offset].count(b"\n") + 1
    assert message.startswith(f"{path}: not UTF-8 text: byte 0xe9 at byte offset {offset + 5} "
                              f"(line {line}, byte 6 of the line)")
    assert message.endswith("save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def test_wrong_type(job):
    message = error_of(load_config, job(megatron_training={"global_batch_size": "four"}))
    assert message.startswith("megatron_training.global_batch_size='four': expected an integer")
    message = error_of(load_config, job(megatron_training={"bf16": "yes please"}))
    assert "megatron_training.bf16" in message and "true or false" in message
    message = error_of(load_config, job(rl_config={"verifier_function": "math_answer"}))
    assert "rl_config.verifier_function" in message and "a list" in message


def test_wrong_type_in_model_yaml(job, tmp_path):
    (tmp_path / "model" / "tiny.yaml").write_text(
        yaml.safe_dump({**TINY_MODEL, "hidden_size": "64"}))
    message = error_of(load_config, job())
    assert "model.hidden_size='64'" in message and "tiny.yaml" in message
    (tmp_path / "model" / "tiny.yaml").write_text(
        yaml.safe_dump({**TINY_MODEL, "num_hiden_layers": 2}))
    assert "did you mean model.num_hidden_layers?" in error_of(load_config, job())


def test_override_of_unknown_key(job):
    message = error_of(load_config, job(), ["rl_config.n_sample_per_prompt=8"])
    assert message == ("rl_config.n_sample_per_prompt (command-line override): unknown key; "
                       "did you mean rl_config.n_samples_per_prompt?")
    assert "unknown section" in error_of(load_config, job(), ["rl.epochs=1"])
    assert "is a section" in error_of(load_config, job(), ["generate_config.sampling_config=1"])
    message = error_of(load_config, job(), ["rl_config.epochs=two"])
    assert "rl_config.epochs='two' (command-line override): expected an integer" in message


def test_bad_choice(job):
    message = error_of(load_config, job(actor_config={"lr_decay_style": "cosin"}))
    assert "actor_config.lr_decay_style='cosin'" in message and "did you mean cosine?" in message


def test_global_batch_not_divisible_by_generation_dp(job):
    config = load_config(job(megatron_training={"global_batch_size": 6},
                             rl_config={"mini_batch_size": 3}))
    message = error_of(make_plan, config, 8)     # TP_g=2 -> generation DP 4
    assert message.startswith("megatron_training.global_batch_size=6: not divisible by the "
                              "generation data-parallel size 4")


def test_mini_batch_checks(job):
    message = error_of(load_config, job(rl_config={"mini_batch_size": 3}))
    assert message.startswith("rl_config.mini_batch_size=3: does not divide "
                              "megatron_training.global_batch_size=4")
    config = load_config(job(actor_config={"micro_batch_size": 3}))
    message = error_of(make_plan, config, 4)     # 2 prompts x 4 samples over DP 2 x mbs 3
    assert "rl_config.mini_batch_size=2" in message and "actor_config.micro_batch_size=3" in message


def test_responses_past_max_model_len_stop_there(job):
    """vLLM stops a response at max_model_len (finish reason "length"): prompt + max_tokens
    beyond it runs, with a warning; a prompt limit that fills it cannot, nor rows continued
    from their tokens so far (partial rollout, tool turns) that outgrow it."""
    config = load_config(job(generate_config={"max_model_len": 512,
                                              "sampling_config": {"max_tokens": 512}}))
    assert config.warnings == (
        "generate_config.sampling_config.max_tokens=512: rl_config.max_prompt_length=256 + "
        "max_tokens=512 = 768 is larger than generate_config.max_model_len=512: vLLM stops the "
        "response to a longest prompt at max_model_len, 256 tokens short of max_tokens "
        "(finish reason \"length\"), as MindSpeed-RL runs it; set max_tokens: 256 to say so, or "
        "max_model_len: 768 for whole responses",)
    message = error_of(load_config, job(rl_config={"max_prompt_length": 512},
                                        generate_config={"max_model_len": 512}))
    assert message == ("rl_config.max_prompt_length=512: a longest prompt leaves no room for a "
                       "response in generate_config.max_model_len=512; lower max_prompt_length "
                       "to at most 511 or raise generate_config.max_model_len to at least 576")
    message = error_of(load_config, job(rl_config={"partial_rollout_max_split": 2},
                                        generate_config={"max_model_len": 512,
                                                         "sampling_config": {"max_tokens": 512}}))
    assert message.startswith("generate_config.sampling_config.max_tokens=512: rl_config."
                              "max_prompt_length=256 + max_tokens=512 = 768 is larger than "
                              "generate_config.max_model_len=512, and partial rollout "
                              "(rl_config.partial_rollout_max_split) continues a row from its "
                              "tokens so far, which must all fit; lower max_tokens to at most "
                              "256"), message


def test_seq_length_is_the_prompt_data_length(job):
    """seq_length means what it means in MindSpeed-RL: the prompt data's length, not
    prompt + response (their configs set it to max_prompt_length)."""
    config = load_config(job(megatron_training={"seq_length": 256},
                             rl_config={"max_prompt_length": 256},
                             generate_config={"max_model_len": 512}))
    assert config.megatron_training.seq_length == 256 and config.warnings == ()
    # shorter than max_prompt_length: MindSpeed-RL cuts the prompts, so does the run, warned
    config = load_config(job(megatron_training={"seq_length": 128}))
    assert config.warnings == (
        "megatron_training.seq_length=128 is shorter than rl_config.max_prompt_length=256: "
        "prompts longer than 128 tokens are cut to their first 128 tokens (those longer than "
        "256 dropped first), as MindSpeed-RL reads its prompt data; raise seq_length to 256 to "
        "keep whole prompts",)
    message = error_of(load_config, job(megatron_training={"seq_length": 1024},
                                        generate_config={"max_model_len": 512}))
    assert "exceeds generate_config.max_model_len=512" in message


def test_verifier_length_mismatch(job):
    message = error_of(load_config, job(rl_config={"verifier_function": ["math_answer", "format"],
                                                   "verifier_weight": [1.0]}))
    assert message.startswith("rl_config.verifier_weight=[1.0]: has 1 weights for 2")


def test_sequence_parallel_needs_tp(job):
    message = error_of(load_config, job(megatron_training={"sequence_parallel": True},
                                        actor_config={"tensor_model_parallel_size": 1}))
    assert "megatron_training.sequence_parallel" in message and "> 1" in message


def test_group_needs_samples_and_temperature(job):
    assert "at least 2" in error_of(load_config, job(rl_config={"n_samples_per_prompt": 1}))
    message = error_of(load_config, job(generate_config={"sampling_config": {"temperature": 0}}))
    assert message.startswith("generate_config.sampling_config.temperature=0.0: greedy")


def test_missing_data_file_named(job, tmp_path):
    path = job(megatron_training={"data_path": "nope.jsonl"})
    message = error_of(load_config, path)
    assert message.startswith(f"megatron_training.data_path='{tmp_path / 'nope.jsonl'}'")
    load_config(path, check_data=False)          # the dry-run needs no data


def test_model_divisibility(job):
    config = load_config(job(actor_config={"tensor_model_parallel_size": 8}))
    message = error_of(make_plan, config, 8)
    assert message.startswith("actor_config.tensor_model_parallel_size=8 does not divide the "
                              "model's num_attention_heads=4")
    assert "accepts" not in message              # no world size can fix it
    config = load_config(job(actor_config={"pipeline_model_parallel_size": 4}))
    message = error_of(make_plan, config, 8)
    assert "actor_config.pipeline_model_parallel_size=4" in message
    assert "num_hidden_layers=2" in message
    assert "has no experts" in error_of(load_config, job(actor_config={
        "expert_model_parallel_size": 2}))


# ---- PPO ------------------------------------------------------------------------------------

def test_ppo_config_dry_run_plans_critic_and_reward_model(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "configs" / "ppo_qwen25_7b.yaml", check_data=False,
                         algorithm="ppo")
    assert config.rl_config.adv_estimator == "gae"        # resolved from the launcher
    plan = make_plan(config, 16).to_dict()
    assert plan["samples"]["critic_micro_batches_per_mini_batch"] == 32
    memory = plan["memory_bytes"]
    assert memory["critic"] > memory["actor_params"] and memory["reward_model"] > 0
    assert plan["phase_bytes"]["critic_phase"] > plan["phase_bytes"]["training_phase"]
    assert main(["--algorithm", "ppo", "--config", "configs/ppo_qwen25_7b.yaml", "--dry-run",
                 "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "critic (params + fp32 grads + optimizer; on host when idle)" in out
    assert "reward model (bf16; on host when idle)" in out


def test_ppo_needs_a_critic_and_grpo_refuses_one(job):
    path = job()
    message = error_of(load_config, path, algorithm="ppo")
    assert message.startswith("critic_config: pretrain_ppo.py needs a critic_config section")
    message = error_of(load_config, path, ["critic_config.lr=1e-5"], algorithm="grpo")
    assert "critic_config" in message and "pretrain_grpo.py trains no critic" in message
    message = error_of(load_config, path, ["rl_config.adv_estimator=gae"], algorithm="grpo")
    assert "pretrain_grpo.py runs GRPO, whose estimator is group_norm" in message
    assert "launch pretrain_ppo.py for gae" in message


@pytest.mark.parametrize("override, expected", [
    ("rl_config.critic_warmup=10", "rl_config.critic_warmup=10: must be smaller than "
                                   "megatron_training.train_iters=10"),
    ("critic_config.pipeline_model_parallel_size=2",
     "critic_config.pipeline_model_parallel_size=2: differs from "
     "actor_config.pipeline_model_parallel_size=1"),
    ("rl_config.kl_ctrl_type=adaptive", "rl_config.kl_ctrl_type='adaptive': the adaptive KL "
                                        "controller scales the KL in the reward"),
    ("rl_config.lam=1.5", "rl_config.lam=1.5: must lie in [0, 1]"),
    ("critic_config.micro_batch_size=3", "critic_config.micro_batch_size=3"),
])
def test_bad_ppo_values_name_the_key(job, override, expected):
    path = job()
    config_error = error_of(lambda: make_plan(load_config(
        path, ["critic_config.lr=1e-5", "megatron_training.train_iters=10", override],
        algorithm="ppo"), 2))
    assert expected in config_error


@pytest.mark.parametrize("name, world, tp, ep", [("dapo_qwen25_7b", 16, 4, 1),
                                                 ("dapo_qwen3_30b_a3b", 16, 4, 8)])
def test_dapo_configs_dry_run_at_their_world_size(monkeypatch, name, world, tp, ep):
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "configs" / f"{name}.yaml", check_data=False)
    rl = config.rl_config
    assert rl.filter_groups_enable and rl.overlong_buffer_len > 0 and rl.init_kl_coef == 0
    assert (rl.policy_loss == "gspo") == (ep > 1)
    plan = make_plan(config, world).to_dict()
    train = plan["layout"]["training"]
    assert (train["tensor_model_parallel_size"], train["expert_model_parallel_size"]) == (tp, ep)
    assert plan["samples"]["prompts_per_generation_round"] == rl.gen_batch_size
    assert plan["phase_bytes"]["training_phase"] < 48 * GIB


@pytest.mark.parametrize("override, expected", [
    ("rl_config.clip_ratio_high=0.1", "rl_config.clip_ratio_high=0.1: is smaller than "
                                      "rl_config.clip_ratio_low=0.2"),
    ("rl_config.loss_agg_mode=token-sum", "rl_config.loss_agg_mode='token-sum' (command-line "
                                          "override): not an accepted value; use one of: "
                                          "token-mean"),
    ("rl_config.policy_loss=gpo", "rl_config.policy_loss='gpo' (command-line override): not an "
                                  "accepted value; use one of: vanilla, gspo"),
    ("rl_config.overlong_buffer_len=64", "rl_config.overlong_buffer_len=64: must be in [0, "
                                         "generate_config.sampling_config.max_tokens=64)"),
    ("rl_config.n_samples_per_prompt=1", "rl_config.filter_groups_enable=true: with "
                                         "n_samples_per_prompt=1 every group has one sample"),
    ("rl_config.clip_ratio_c=1.0", "rl_config.clip_ratio_c=1.0: the dual-clip bound must be "
                                   "greater than 1"),
])
def test_bad_dapo_values_fail_before_any_process_group(job, override, expected):
    path = job(rl_config={"filter_groups_enable": True})
    assert expected in error_of(load_config, path, [override])


@pytest.mark.parametrize("overrides, expected", [
    (["rl_config.rollout_is=token", "rl_config.rollout_is_threshold_lower=2.0"],
     "rl_config.rollout_is_threshold_lower=2.0: must lie in [0, rollout_is_threshold=2.0)"),
    (["rl_config.rollout_is=sequence", "rl_config.rollout_is_threshold=1.5",
      "rl_config.rollout_is_threshold_lower=3"],
     "rl_config.rollout_is_threshold_lower=3.0: must lie in [0, rollout_is_threshold=1.5)"),
    (["rl_config.rollout_is_batch_normalize=true"],
     "rl_config.rollout_is_batch_normalize=true: only acts on rollout_is weights"),
    (["rl_config.rollout_rs=token", "rl_config.rollout_rs_threshold=2.0",
      "rl_config.rollout_rs_threshold_lower=2.5"],
     "rl_config.rollout_rs_threshold_lower=2.5: must lie in [0, rollout_rs_threshold=2.0)"),
    (["rl_config.rollout_rs=geometric"], "rl_config.rollout_rs_threshold=null: "
                                         "rollout_rs=geometric needs a positive upper bound"),
    (["rl_config.rollout_rs_threshold=2.0"], "rl_config.rollout_rs_threshold=2.0: bounds the "
                                             "band of rollout_rs, and rollout_rs is null"),
    (["rl_config.rollout_is=tokens"], "rl_config.rollout_is='tokens' (command-line override): "
                                      "not an accepted value; use one of: token, sequence"),
    (["rl_config.rollout_token_veto_threshold=2"],
     "rl_config.rollout_token_veto_threshold=2.0: must lie in (0, 1)"),
    (["rl_config.max_weight_version_lag=0"], "rl_config.max_weight_version_lag=0: is below the "
                                             "1 versions the last of the iteration's 2"),
])
def test_bad_rollout_correction_values_name_the_key(job, overrides, expected):
    assert expected in error_of(load_config, job(), overrides)


def test_docs_key_reference_is_the_schema():
    """docs/config.md's key reference is generated from the schema: regenerate it with
    `python -m mindspeed_rl.config.reference --write` after changing a key."""
    from mindspeed_rl.config.reference import key_reference, mindspeed_tables

    docs = (REPO / "docs" / "config.md").read_text()
    assert docs.endswith(key_reference())
    assert mindspeed_tables() in docs
