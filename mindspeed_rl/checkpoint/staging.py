"""Write a directory all-or-nothing: into a temporary sibling, renamed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mindspeed_rl.errors import CheckpointError


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a written file's data to the disk (a crash after the rename keeps its bytes)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it survives a crash of the node)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_dir(save_dir: str | os.PathLike, overwrite: bool) -> None:
    """Refuse a non-empty ``save_dir`` unless ``overwrite`` (checked before any work)."""
    save_dir = Path(save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise CheckpointError(f"{save_dir}: exists and is not a directory")
    if save_dir.is_dir() and any(save_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{save_dir}: not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def staged_output_dir(save_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``save_dir``; on success it becomes ``save_dir``.

    A failure (or a kill) leaves ``save_dir`` untouched; the temporary directory is removed
    on failure (a kill leaves a hidden ``.<name>.tmp-*`` sibling, never a half-written save_dir).
    """
    save_dir = Path(save_dir).absolute()
    check_output_dir(save_dir, overwrite)
    save_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.tmp-", dir=save_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would survive the rename
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if save_dir.exists():
        # Move the old directory aside first so there is never a moment without one of them.
        old = Path(tempfile.mkdtemp(prefix=f".{save_dir.name}.old-", dir=save_dir.parent))
        os.rmdir(old)
        os.replace(save_dir, old)
        os.replace(tmp, save_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, save_dir)
