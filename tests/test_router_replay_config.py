"""rl_config.router_replay: the dry run refuses the jobs where routes cannot be recorded or
replayed, naming the key, and runs R3 without prefix caching (pure Python)."""

from __future__ import annotations

import pytest
import yaml

from mindspeed_rl.config import ConfigError, load_config

DENSE = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
}
MOE = {**DENSE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
       "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINDSPEED_RL_DEVICE", "cpu")
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')

    def write(model: dict, **updates):
        (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
        config = {
            "megatron_training": {"model": "model.yaml", "tokenizer_name_or_path": "./tok",
                                  "data_path": "train.jsonl", "global_batch_size": 4},
            "actor_config": {"tensor_model_parallel_size": 1},
            "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 2},
            "generate_config": {"infer_tensor_parallel_size": 1, "enable_prefix_caching": False,
                                "sampling_config": {"max_tokens": 64}},
        }
        for section, values in updates.items():
            config.setdefault(section, {}).update(values)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


def error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_on_a_dense_model_is_refused(job, mode):
    message = error(job(DENSE), [f"rl_config.router_replay={mode}"])
    assert f"rl_config.router_replay='{mode}'" in message
    assert "qwen2 has none" in message and "router_replay: none" in message


@pytest.mark.parametrize("key", ["pipeline_model_parallel_size", "context_parallel_size"])
def test_replay_with_a_layout_it_cannot_record_is_refused(job, key):
    message = error(job(MOE, actor_config={key: 2}, rl_config={"router_replay": "R2"}))
    assert "rl_config.router_replay='R2'" in message and f"actor_config.{key}=2" in message


def test_r3_runs_without_prefix_caching(job):
    """R3 records the experts of every prompt token as vLLM computes them; a cached prefix is
    not computed again: a job asking for R3 runs with prefix caching off, and says so."""
    said = ("generate_config.enable_prefix_caching=true: turned off for rl_config.router_replay "
            "R3, which records the experts of every prompt token as vLLM computes them (a "
            "cached prefix is not computed again, so it would have no routes); prefix caching "
            "only saves prefill time")
    config = load_config(job(MOE, generate_config={"enable_prefix_caching": True}),
                         ["rl_config.router_replay=R3"])
    assert not config.generate_config.enable_prefix_caching and said in config.warnings
    path = job(MOE)
    text = path.read_text().replace("  enable_prefix_caching: false\n", "")
    path.write_text(text)   # the default (true)
    config = load_config(path, ["rl_config.router_replay=R3"])
    assert not config.generate_config.enable_prefix_caching and config.warnings == ()
    assert said.replace("=true:", "=true (the default):") in config.notices
    for mode in ("none", "R2"):   # their routes are not vLLM's: the cache stays
        assert load_config(path, [f"rl_config.router_replay={mode}"]).generate_config.\
            enable_prefix_caching


def test_r3_on_a_platform_without_in_process_capture_is_refused(job, monkeypatch):
    monkeypatch.setenv("MINDSPEED_RL_DEVICE", "npu")
    message = error(job(MOE), ["rl_config.router_replay=R3"])
    assert "rl_config.router_replay='R3'" in message and "npu" in message
    assert "router_replay: R2" in message


@pytest.mark.parametrize("mode", ["none", "R2", "R3"])
def test_moe_jobs_with_replay_load(job, mode):
    config = load_config(job(MOE), [f"rl_config.router_replay={mode}"])
    assert config.rl_config.router_replay == mode
