"""A checkpoint folder's manifest: every file with its size and SHA-256, verified on load.

``iter_0000010/manifest.json`` (and ``release/manifest.json``) is written last, into the
temporary folder, before the folder is renamed and the tracker file names it; so a
folder the tracker names always has one, and a folder without one was never finished.
Loading checks every listed file (present, same size, same checksum) before
megatron reads a byte of it, and names the first file that differs.

Both writing and checking are collective when torch.distributed is up: the folder's
files are split over the ranks (rank ``r`` hashes files ``r, r + world, ...``) and the
results gathered, so a 100 GB checkpoint is hashed by all ranks in parallel; every rank
ends with the same manifest or the same error. Without torch.distributed (the
converter) one process does it all.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

from mindspeed_rl.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
FORMAT = "mindspeed_rl.checkpoint_manifest"
VERSION = 1
_CHUNK = 1 << 22


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    """Relative paths of the folder's files (sorted: every rank lists them alike)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILE)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value):
    rank, world = _world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def describe_files(folder: str | os.PathLike) -> dict[str, dict]:
    """Collective: ``{relative path: {"size", "sha256"}}`` of every file under ``folder``."""
    folder = Path(folder)
    rank, world = _world()
    mine = {}
    for name in _files(folder)[rank::world]:
        path = folder / name
        mine[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        with open(path, "rb") as f:  # on disk before the manifest vouches for it
            os.fsync(f.fileno())
    files: dict[str, dict] = {}
    for part in _gather(mine):
        files.update(part)
    return dict(sorted(files.items()))


def write_manifest(folder: str | os.PathLike, files: dict[str, dict]) -> Path:
    """Write ``folder/manifest.json`` for ``files`` (from :func:`describe_files`) atomically."""
    path = Path(folder) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "algorithm": "sha256",
                               "files": files}, indent=1) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(folder: str | os.PathLike) -> dict[str, dict]:
    """The manifest's ``{relative path: {"size", "sha256"}}`` (CheckpointError if unusable)."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {folder} was never completed (a save that was interrupted) or "
            "predates manifests: load another iteration, or re-create it with "
            "tools/convert_ckpt.py")
    try:
        data = json.loads(path.read_bytes())
        # Valid JSON of another shape (a list, entries without a size) is as unusable as
        # broken JSON: this checkpoint does not verify, and a resume falls back past it.
        if not isinstance(data, dict):
            raise ValueError(f"holds a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r} is not {FORMAT!r}")
        files = data.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str) for entry in files.values()):
            raise ValueError("'files' is not a mapping of file -> {size, sha256}")
        return dict(files)
    except ValueError as exc:  # json's errors (UnicodeDecodeError too) are ValueErrors
        raise CheckpointError(f"{path}: not a checkpoint manifest ({exc})") from exc


def _check_file(folder: Path, name: str, expected: dict, manifest: Path,
                with_checksum: bool) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{path}: missing (listed in {manifest})"
    size = path.stat().st_size
    if size != expected["size"]:
        return (f"{path}: {'truncated' if size < expected['size'] else 'wrong size'}: "
                f"{size} bytes, {manifest} lists {expected['size']}")
    if with_checksum and _sha256(path) != expected["sha256"]:
        return f"{path}: contents differ from the checksum in {manifest} (corrupted)"
    return None


# Folders this process verified, with their manifest's (mtime, size): reading a checkpoint's
# tensor list and then its tensors hashes it once, not twice.
_verified: dict[Path, tuple[int, int]] = {}


def _manifest_stamp(folder: Path) -> tuple[int, int] | None:
    try:
        st = (folder / MANIFEST_FILE).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def verify_checkpoint(folder: str | os.PathLike) -> None:
    """Collective: raise the same CheckpointError on every rank unless every file the
    manifest lists is present, of its size and checksum. The message names the file."""
    folder = Path(folder)
    stamp = _manifest_stamp(folder)
    if stamp is not None and _verified.get(folder.absolute()) == stamp:
        return
    manifest = folder / MANIFEST_FILE
    rank, world = _world()
    problem = None
    try:
        files = read_manifest(folder)
        names = sorted(files)
        # Sizes everywhere (cheap, catches truncation at once), checksums split over ranks.
        for i, name in enumerate(names):
            problem = _check_file(folder, name, files[name], manifest, i % world == rank)
            if problem:
                break
    except CheckpointError as exc:
        problem = str(exc)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(
            f"{problems[0]}; the checkpoint {folder} is damaged: load an earlier iteration "
            f"(point {folder.parent}/latest_checkpointed_iteration.txt at it) or save again")
    if stamp is not None:
        _verified[folder.absolute()] = stamp
