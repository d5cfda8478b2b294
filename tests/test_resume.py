"""Resuming like a cluster job script expects: the same folder for load and save on every
launch, a damaged latest checkpoint that falls back to the newest one that verifies, and
two jobs on one folder that never delete each other's saves. Checkpoint folders here are
files with a manifest (what verification reads); megatron is not needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindspeed_rl.checkpoint import trainer_state
from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.checkpoint.manifest import describe_files, write_manifest
from mindspeed_rl.checkpoint.megatron_dir import META_FILE, TRACKER_FILE
from mindspeed_rl.checkpoint.weight_source import HF, actor_start, is_training_checkpoint


def _saved(root: Path, *iterations: int) -> Path:
    """``root`` as the trainer leaves it after saving ``iterations`` (last one latest)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / META_FILE).write_text("{}")
    for it in iterations:
        folder = root / f"iter_{it:07d}"
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"meta %d" % it)
        (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * (it + 1))
        write_manifest(folder, describe_files(folder))
        (root / TRACKER_FILE).write_text(f"{it}\n")
    _forget()
    return root


def _forget() -> None:
    """A new run: nothing resolved or verified yet."""
    from mindspeed_rl.checkpoint import manifest

    trainer_state._resolved.clear()
    manifest._verified.clear()


def test_damaged_latest_checkpoint_falls_back_to_the_newest_that_verifies(tmp_path, capsys):
    root = _saved(tmp_path / "ckpt", 2, 4, 6)
    shard = root / "iter_0000006" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-5])  # a save cut short by a full disk
    assert is_training_checkpoint(root)
    assert trainer_state.resume_path(root) == root / "iter_0000004"
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"resume: the latest checkpoint {root / 'iter_0000006'} is damaged (")
    assert str(shard) in line and f"resuming from {root / 'iter_0000004'}" in line


def test_latest_folder_gone_falls_back_too(tmp_path, capsys):
    import shutil

    root = _saved(tmp_path / "ckpt", 2, 4)
    shutil.rmtree(root / "iter_0000004")
    assert is_training_checkpoint(root)
    assert trainer_state.resume_path(root) == root / "iter_0000002"
    assert "resuming from" in capsys.readouterr().out


def test_intact_latest_is_resumed_silently_and_none_verifying_names_the_damage(tmp_path, capsys):
    root = _saved(tmp_path / "ckpt", 2, 4)
    assert trainer_state.resume_path(root) == root / "iter_0000004"
    assert capsys.readouterr().out == ""
    for it in (2, 4):
        (root / f"iter_{it:07d}" / "__0_0.distcp").write_bytes(b"x")
    _forget()
    with pytest.raises(CheckpointError, match="iter_0000004/__0_0.distcp: truncated: .* no "
                                              "earlier checkpoint in .* verifies either"):
        trainer_state.resume_path(root)


def test_load_equal_to_save_on_an_empty_folder_starts_from_the_model(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    for folder in (tmp_path / "ckpt", tmp_path / "absent"):
        folder.mkdir(exist_ok=folder.name == "ckpt")
        if folder.name == "absent":
            folder.rmdir()
        start = actor_start(str(hf), str(folder), save=str(folder))
        assert start.kind == HF and start.path == str(hf)
        assert "holds no checkpoint yet, so the run starts from the model" in start.describe()
    with pytest.raises(CheckpointError, match="holds no weights"):  # a different folder: a typo
        actor_start(str(hf), str(tmp_path / "ckpt"), save=str(tmp_path / "other"))
    assert actor_start(str(hf), str(_saved(tmp_path / "ckpt", 2)), save=str(tmp_path / "ckpt")) is None


def test_stale_save_of_a_killed_job_is_swept_but_a_live_one_is_kept(tmp_path):
    root = _saved(tmp_path / "ckpt", 2)
    dead = root / "iter_0000004.tmp"            # a killed job's, no lock held
    dead_new = root / "iter_0000004.tmp.node1.123"
    for d in (dead, dead_new):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"half")
    live, lock = trainer_state._claim_tmp(root, root / "iter_0000004")  # another job's save
    try:
        (live / "__0_0.distcp").write_bytes(b"in flight")
        trainer_state._sweep_stale_saves(root)
        assert not dead.exists() and not dead_new.exists()
        assert (live / "__0_0.distcp").read_bytes() == b"in flight"
    finally:
        trainer_state._release(lock)
    trainer_state._sweep_stale_saves(root)  # its job ended without renaming it: now stale
    assert not live.exists() and (root / "iter_0000002").is_dir()
    assert not list(root.glob(".*.lock"))


def test_publish_fsyncs_files_folder_and_tracker(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(trainer_state, "fsync_dir", lambda p: synced.append(("dir", Path(p))))
    monkeypatch.setattr(trainer_state, "fsync_file", lambda p: synced.append(("file", Path(p).name)))
    root = _saved(tmp_path / "ckpt", 2)
    tmp, lock = trainer_state._claim_tmp(root, root / "iter_0000004")
    (tmp / "common.pt").write_bytes(b"c")
    trainer_state._publish(tmp, root / "iter_0000004", describe_files(tmp), 4)
    trainer_state._release(lock)
    assert (root / TRACKER_FILE).read_text() == "4\n"
    assert ("dir", root) in synced and ("dir", tmp) in synced
    assert any(kind == "file" and name.startswith(TRACKER_FILE) for kind, name in synced)
    assert synced[-1] == ("dir", root)  # the tracker's rename is on disk last



def two_rank_resume_body(root: str) -> str:
    return str(trainer_state.resume_path(root))


def test_two_ranks_resolve_the_same_fallback(tmp_path):
    """The tracker and the folder list come from rank 0; verification is collective."""
    from mindspeed_rl.testing import run_on_ranks

    root = _saved(tmp_path / "ckpt", 2, 4)
    (root / "iter_0000004" / "__0_0.distcp").write_bytes(b"x")
    assert run_on_ranks(two_rank_resume_body, 2, str(root), timeout=120) == [
        str(root / "iter_0000002")] * 2
