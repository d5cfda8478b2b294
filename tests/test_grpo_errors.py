"""Bad input to pretrain_grpo.py fails fast, names the key / file / row, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.models.tiny import make_tiny_hf_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    model = make_tiny_hf_dir("qwen2", root / "qwen2")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return {"root": root, "model": model, "data": data}


def run(assets, *overrides, config=CONFIG, world_size=None, timeout=300):
    """The launcher as a single process (a world of one) unless WORLD_SIZE is given."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    if world_size:
        env["WORLD_SIZE"] = str(world_size)
    cmd = [sys.executable, str(ROOT / "pretrain_grpo.py"), "--config", str(config),
           f"megatron_training.model={assets['model']}", f"megatron_training.data_path={assets['data']}",
           f"megatron_training.log_dir={assets['root'] / 'logs'}",
           f"actor_config.save={assets['root'] / 'ckpt'}", *overrides]
    proc = subprocess.run(cmd, cwd=assets["root"], capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stderr


def test_misspelled_key(assets):
    rc, err = run(assets, "rl_config.n_sample_per_prompt=4")
    assert rc == 2
    assert "rl_config.n_sample_per_prompt" in err and "rl_config.n_samples_per_prompt" in err


def test_misspelled_key_in_yaml(assets, tmp_path):
    text = CONFIG.read_text().replace("  clip_ratio: 0.2", "  clip_ration: 0.2")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    rc, err = run(assets, config=bad)
    assert rc == 2 and "rl_config.clip_ration" in err and "did you mean rl_config.clip_ratio" in err


def test_global_batch_not_divisible_by_dp(assets):
    rc, err = run(assets, "megatron_training.global_batch_size=3", "rl_config.mini_batch_size=3",
                  world_size=2)
    assert rc == 2 and "megatron_training.global_batch_size=3" in err


def test_a_prompt_limit_that_fills_max_model_len(assets):
    """(prompt + max_tokens beyond max_model_len runs: vLLM stops the response there, warned;
    test_config.py tests it.)"""
    rc, err = run(assets, "rl_config.max_prompt_length=96")
    assert rc == 2
    assert "rl_config.max_prompt_length=96: a longest prompt leaves no room for a response in " \
           "generate_config.max_model_len=96" in err


def test_missing_dataset_file(assets):
    missing = assets["root"] / "nope.jsonl"
    rc, err = run(assets, f"megatron_training.data_path={missing}")
    assert rc == 2 and str(missing) in err


def test_row_without_prompt_field(assets, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"question": "What is 2+2?", "answer": "4"}) + "\n")
    rc, err = run(assets, f"megatron_training.data_path={data}",
                  "actor_config.tensor_model_parallel_size=1")
    assert rc == 2 and "row 1" in err and str(data) in err and "'prompt'" in err


def test_tokenizer_without_chat_template(assets, tmp_path):
    import shutil

    model = tmp_path / "no_template"
    shutil.copytree(assets["model"], model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, err = run(assets, f"megatron_training.model={model}",
                  "actor_config.tensor_model_parallel_size=1")
    assert rc == 2 and "chat_template" in err and str(model) in err
    assert not (assets["root"] / "ckpt").exists()  # nothing written before the failure
