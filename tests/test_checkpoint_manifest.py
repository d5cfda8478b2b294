"""Checkpoint manifests: every file's size and SHA-256, written with the checkpoint and verified
before anything is loaded, by the trainer and by tools/convert_ckpt.py alike."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.checkpoint import CheckpointError, verify_checkpoint
from mindspeed_rl.checkpoint.convert import convert_hf_to_mg, convert_mg_to_hf
from mindspeed_rl.checkpoint.manifest import MANIFEST_FILE
from mindspeed_rl.models.tiny import make_tiny_hf_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifest")
    return convert_hf_to_mg(make_tiny_hf_dir("qwen2", root / "hf"), root / "mg")


def test_manifest_lists_every_file_with_size_and_checksum(mg_dir):
    folder = mg_dir / "release"
    listed = json.loads((folder / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(listed) == on_disk and len(on_disk) >= 3
    for name, entry in listed.items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    verify_checkpoint(folder)


def _damage(folder: Path, how: str) -> Path:
    shard = sorted(folder.glob("*.distcp"))[0]
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif how == "missing":
        shard.unlink()
    elif how == "corrupted":  # same size, one byte flipped
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:  # the save never finished: no manifest
        shard = folder / MANIFEST_FILE
        shard.unlink()
    return shard


@pytest.mark.parametrize("how, message", [
    ("truncated", "{file}: truncated: "),
    ("missing", "{file}: missing (listed in "),
    ("corrupted", "{file}: contents differ from the checksum in "),
    ("no_manifest", "{file}: missing; {folder} was never completed"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(mg_dir, tmp_path, how, message):
    copy = tmp_path / "mg"
    shutil.copytree(mg_dir, copy)
    damaged = _damage(copy / "release", how)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(copy / "release")
    assert message.format(file=damaged, folder=copy / "release") in str(e.value)
    with pytest.raises(CheckpointError, match="the checkpoint .* is damaged|never completed"):
        convert_mg_to_hf(copy, tmp_path / "hf_out")
    assert not (tmp_path / "hf_out").exists()


def test_convert_tool_reports_a_truncated_shard_in_one_line(mg_dir, tmp_path):
    copy = tmp_path / "mg"
    shutil.copytree(mg_dir, copy)
    shard = _damage(copy / "release", "truncated")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_ckpt.py"),
                           "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                           str(copy), "--save-dir", str(tmp_path / "out"), "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"convert_ckpt: error: {shard}: truncated: ")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- pickled parts of a checkpoint someone else wrote ----------------------------------------

class _RunsShell:
    """Pickles to ``os.system(command)``: what a hostile checkpoint's .metadata would hold."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _hostile(mg_dir: Path, tmp_path: Path, part: str) -> tuple[Path, Path, Path]:
    """A copy of ``mg_dir`` as Megatron-LM would leave it (no manifest or meta of ours, the
    HF config elsewhere) whose ``part`` pickle writes a marker file when unpickled."""
    copy, hf = tmp_path / "mg", tmp_path / "hf_config"
    shutil.copytree(mg_dir, copy)
    hf.mkdir()
    for path in copy.iterdir():
        if path.is_file() and path.name != "latest_checkpointed_iteration.txt":
            shutil.move(path, hf / path.name)
    (hf / "mindspeed_rl_meta.json").unlink()
    (copy / "release" / MANIFEST_FILE).unlink()
    marker = tmp_path / "code_ran"
    target = copy / "release" / part
    if part == ".metadata":
        import pickle

        target.write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    else:
        import torch

        torch.save({"common": _RunsShell(f"touch {marker}")}, target)
    return copy, hf, marker


@pytest.mark.parametrize("part", [".metadata", "common.pt"])
def test_checkpoint_pickle_that_runs_code_is_refused_naming_the_file(mg_dir, tmp_path, part):
    from mindspeed_rl.checkpoint.megatron_dir import checkpoint_tensor_keys
    from mindspeed_rl.checkpoint.safe_load import UntrustedPickleError

    copy, hf, marker = _hostile(mg_dir, tmp_path, part)
    target = copy / "release" / part
    if part == ".metadata":
        with pytest.raises(UntrustedPickleError, match="posix.system|os.system") as e:
            checkpoint_tensor_keys(copy)
        assert str(target) in str(e.value) and "--trust-checkpoint" in str(e.value)
        assert not marker.exists()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_ckpt.py"),
                           "--load-model-type", "mg", "--save-model-type", "hf", "--load-dir",
                           str(copy), "--save-dir", str(tmp_path / "out"), "--no-progress",
                           "--hf-config-dir", str(hf)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"convert_ckpt: error: {target}: "), last
    assert "trust_checkpoint" in last and not (tmp_path / "out").exists()


def test_our_checkpoint_with_a_replaced_metadata_fails_verification_first(mg_dir, tmp_path):
    """A manifest that does not verify stops the load before megatron opens any file."""
    copy = tmp_path / "mg"
    shutil.copytree(mg_dir, copy)
    marker = tmp_path / "code_ran"
    import pickle

    (copy / "release" / ".metadata").write_bytes(pickle.dumps(_RunsShell(f"touch {marker}")))
    with pytest.raises(CheckpointError, match=r"\.metadata: (wrong size|truncated|contents)"):
        convert_mg_to_hf(copy, tmp_path / "out")
    assert not marker.exists()


def test_reading_a_legacy_file_keeps_what_megatron_allowed(tmp_path):
    """torch's ``safe_globals`` context drops its classes on exit, also those registered for
    good before it: a legacy file read must leave megatron-core's allow-list (which a
    torch_dist checkpoint's common.pt read later in the process needs) as it was."""
    import argparse

    import megatron.core  # noqa: F401 - registers its allow-list (argparse.Namespace among it)
    import torch

    from mindspeed_rl.checkpoint.legacy_megatron import read_legacy_file

    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "model": {}}, path)
    assert argparse.Namespace in torch.serialization.get_safe_globals()
    assert read_legacy_file(path)["args"].num_layers == 2
    assert argparse.Namespace in torch.serialization.get_safe_globals()
