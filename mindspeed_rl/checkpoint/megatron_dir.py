"""A megatron checkpoint directory that rebuilds its model from itself alone.

Layout (Megatron conventions, plus the HF files the model and tokenizer come from)::

    MG_DIR/
      config.json, tokenizer files      # the HF config the architecture is built from
      mindspeed_rl_meta.json            # architecture name, format version
      latest_checkpointed_iteration.txt # "release" (converted) or the last iteration number
      release/ | iter_0000100/          # megatron-core distributed checkpoint (torch_dist)

The weights are a megatron-core `dist_checkpointing` checkpoint of the model's
``sharded_state_dict``: each tensor is stored with its global shape and megatron
reshards on load, so one checkpoint loads at any TP/PP/EP layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Collection

import torch.distributed as dist

from mindspeed_rl.checkpoint.errors import CheckpointError

META_FILE = "mindspeed_rl_meta.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
FORMAT = "mindspeed_rl.megatron_dist_checkpoint"
FORMAT_VERSION = 1


def iteration_dir_name(iteration: int | None) -> str:
    """``release`` for converted checkpoints, ``iter_0000100`` for training ones."""
    return RELEASE if iteration is None else f"iter_{iteration:07d}"


def write_meta(mg_dir: str | os.PathLike, architecture: str, **extra) -> None:
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "architecture": architecture, **extra}
    (Path(mg_dir) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(mg_dir: str | os.PathLike) -> dict:
    path = Path(mg_dir) / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {mg_dir} is not a megatron checkpoint written by tools/convert_ckpt.py "
            "or the trainer"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def checkpoint_path(mg_dir: str | os.PathLike, iteration: int | None | str = "latest") -> Path:
    """The dist-checkpoint folder of ``iteration`` ("latest": the tracker file's)."""
    mg_dir = Path(mg_dir)
    if iteration == "latest":
        tracker = mg_dir / TRACKER_FILE
        if not tracker.is_file():
            raise CheckpointError(f"{tracker}: missing; no checkpoint has been saved in {mg_dir}")
        text = tracker.read_text().strip()
        iteration = None if text == RELEASE else int(text)
    path = mg_dir / iteration_dir_name(iteration)
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing checkpoint folder")
    return path


def save_megatron_checkpoint(model, mg_dir: str | os.PathLike, iteration: int | None = None) -> Path:
    """Collectively save ``model`` (this rank's megatron module) and update the tracker file.

    Call on every rank; the dist checkpoint records each shard's place in the global tensor.
    """
    from megatron.core import dist_checkpointing

    path = Path(mg_dir) / iteration_dir_name(iteration)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(path))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (Path(mg_dir) / TRACKER_FILE).write_text(f"{RELEASE if iteration is None else iteration}\n")
    return path


def checkpoint_tensor_keys(mg_dir: str | os.PathLike, iteration: int | None | str = "latest") -> set[str]:
    """The keys of the sharded tensors stored in a checkpoint (read from its metadata only)."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(mg_dir, iteration)
    try:
        return set(dist_checkpointing.load_tensors_metadata(str(path)))
    except Exception as exc:  # noqa: BLE001 - name the folder
        raise CheckpointError(f"{path}: cannot read the checkpoint's tensor metadata: {exc}") from exc


def load_megatron_checkpoint(model, mg_dir: str | os.PathLike, iteration: int | None | str = "latest",
                             exclude: Collection[str] = ()) -> Path:
    """Collectively load this rank's shard of ``model`` from a checkpoint saved at any layout.

    ``exclude``: state-dict keys of ``model`` that are not read (they keep their values).
    """
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = checkpoint_path(mg_dir, iteration)
    try:
        # Megatron-LM's torch_dist checkpoints pickle their args into common.pt; torch.load
        # is weights_only by default and megatron-core registers its allow-list (its args
        # Namespace, numpy RNG state, its enums) with torch when it is imported.
        with torch.no_grad():
            request = {k: v for k, v in model.sharded_state_dict().items() if k not in exclude}
            state = dist_checkpointing.load(request, str(path))
            # A trainer checkpoint also holds optimizer, RNG and run state; dist_checkpointing
            # returns its non-sharded part (common.pt) beside what was asked for.
            result = model.load_state_dict({k: v for k, v in state.items() if k in request},
                                           strict=not exclude)
            missing = sorted(set(result.missing_keys) - set(exclude))
            if missing or result.unexpected_keys:
                raise RuntimeError(f"missing keys {missing[:3]}, unexpected keys {result.unexpected_keys[:3]}")
    except CheckpointError:
        raise
    # torch's CheckpointException derives from BaseException and wraps each rank's error.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - name the folder
        raise CheckpointError(
            f"{path}: cannot load into the model built from {Path(mg_dir) / 'config.json'}: "
            f"{_root_cause(exc)}") from exc
    return path


def _root_cause(exc: BaseException) -> str:
    """The first rank's own error message, without torch's per-rank traceback text."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"
