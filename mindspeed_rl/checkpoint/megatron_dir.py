"""A megatron checkpoint directory that rebuilds its model from itself alone.

Layout (Megatron conventions, plus the HF files the model and tokenizer come from)::

    MG_DIR/
      config.json, tokenizer files      # the HF config the architecture is built from
      mindspeed_rl_meta.json            # architecture name, format version
      latest_checkpointed_iteration.txt # "release" (converted) or the last iteration number
      release/ | iter_0000100/          # megatron-core distributed checkpoint (torch_dist)
        manifest.json                   # size and SHA-256 of every file, verified on load

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

from mindspeed_rl.checkpoint.manifest import (MANIFEST_FILE, describe_files, verify_checkpoint,
                                              write_manifest)
from mindspeed_rl.checkpoint.safe_load import UntrustedPickleError, restricted_unpickling
from mindspeed_rl.checkpoint.tracker import TRACKER_FILE, read_tracker
from mindspeed_rl.errors import CheckpointError

META_FILE = "mindspeed_rl_meta.json"
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
        iteration = read_tracker(mg_dir)
    path = mg_dir / iteration_dir_name(iteration)
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing checkpoint folder")
    return path


# TransformerConfig fields that fix the shape of the weights (compared before loading).
_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "kv_channels", "add_qkv_bias", "qk_layernorm",
                 "num_moe_experts", "moe_ffn_hidden_size")


def check_checkpoint_fits(mg_dir: str | os.PathLike, model) -> None:
    """Refuse a checkpoint of another architecture or vocabulary before megatron reads it.

    The checkpoint folder carries the HF config.json it was made from; its megatron
    shape is compared with ``model`` (this rank's GPTModel), and the first field that
    differs is named.
    """
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    from mindspeed_rl.models.hf_io import load_hf_config
    from mindspeed_rl.models.registry import describe_model

    if not (Path(mg_dir) / "config.json").is_file():
        return  # nothing to compare with; megatron's load names the tensor that differs
    saved = describe_model(load_hf_config(mg_dir))
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    differences = []
    for name in _SHAPE_FIELDS:
        expected = saved.transformer_config_kwargs.get(name, defaults.get(name))
        actual = getattr(model.config, name, None)
        if name == "kv_channels" and expected is None:
            continue  # derived from hidden_size / heads, compared through them
        if expected != actual:
            differences.append(f"{name}={expected} (the model has {actual})")
    model_vocab = getattr(model, "vocab_size", None)
    if model_vocab is not None and model_vocab != saved.padded_vocab_size:
        differences.append(f"a vocabulary of {saved.padded_vocab_size} rows after padding "
                           f"(the model has {model_vocab})")
    if differences:
        raise CheckpointError(
            f"{mg_dir}: holds a {saved.name} checkpoint with {'; '.join(differences[:3])} "
            f"(from {Path(mg_dir) / 'config.json'}); start from a checkpoint of the model in "
            "megatron_training.model, or convert this one with tools/convert_ckpt.py and use "
            "it as the model")


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
    files = describe_files(path)  # collective; the manifest makes the folder complete
    if rank == 0:
        write_manifest(path, files)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (Path(mg_dir) / TRACKER_FILE).write_text(f"{RELEASE if iteration is None else iteration}\n")
    return path


def checkpoint_tensor_keys(mg_dir: str | os.PathLike, iteration: int | None | str = "latest") -> set[str]:
    """The keys of the sharded tensors stored in a checkpoint (read from its metadata only)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = checkpoint_path(mg_dir, iteration)
    _verify_if_ours(mg_dir, path)
    try:
        with restricted_unpickling(path):
            return set(dist_checkpointing.load_tensors_metadata(str(path)))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - name the folder
        reraise_untrusted(exc)  # noqa: BLE001 - name the folder
        raise CheckpointError(f"{path}: cannot read the checkpoint's tensor metadata: {exc}") from exc


def _verify_if_ours(mg_dir: str | os.PathLike, path: Path) -> None:
    """Our checkpoints are verified before megatron opens any file of them. One written by
    Megatron-LM itself keeps no manifest: megatron's load checks it, its pickles restricted."""
    if (path / MANIFEST_FILE).is_file() or (Path(mg_dir) / META_FILE).is_file():
        verify_checkpoint(path)  # names a missing or truncated file before megatron reads any


def load_megatron_checkpoint(model, mg_dir: str | os.PathLike, iteration: int | None | str = "latest",
                             exclude: Collection[str] = ()) -> Path:
    """Collectively load this rank's shard of ``model`` from a checkpoint saved at any layout.

    ``exclude``: state-dict keys of ``model`` that are not read (they keep their values).
    """
    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = checkpoint_path(mg_dir, iteration)
    check_checkpoint_fits(mg_dir, model)
    _verify_if_ours(mg_dir, path)
    try:
        # Megatron-LM's torch_dist checkpoints pickle their args into common.pt; weights_only
        # admits them because megatron-core registers its allow-list (its args Namespace,
        # numpy RNG state, its enums) with torch when it is imported.
        with torch.no_grad(), restricted_unpickling(path):
            request = {k: v for k, v in model.sharded_state_dict().items() if k not in exclude}
            asked, finish = _mindspeed_llm_mla_request(model, request, path)
            state = finish(dist_checkpointing.load(asked, str(path)))
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
        reraise_untrusted(exc)
        raise CheckpointError(
            f"{path}: cannot load into the model built from {Path(mg_dir) / 'config.json'}: "
            f"{root_cause(exc)}") from exc
    return path


def _mindspeed_llm_mla_request(model, request: dict, path: Path):
    """``request`` and the identity, or, for a model with multi-latent attention, a request
    that also reads MindSpeed-LLM's names for its MLA tensors (a torch_dist checkpoint saved
    by MindSpeed-LLM; ``mindspeed_llm_mla.torch_dist_request``) and the step that turns
    them into the model's."""
    if not getattr(model.config, "multi_latent_attention", False):
        return request, lambda state: state
    from megatron.core import dist_checkpointing

    from mindspeed_rl.checkpoint import mindspeed_llm_mla

    stored = dist_checkpointing.load_tensors_metadata(str(path))
    dims = {k: getattr(model.config, k) for k in mindspeed_llm_mla.MLA_FIELDS}
    return mindspeed_llm_mla.torch_dist_request(request, stored, dims)


def reraise_untrusted(exc: BaseException) -> None:
    """A refused pickle is reported as itself (it names the file), not as a load failure."""
    failures = getattr(exc, "failures", None)
    cause = next(iter(failures.values()))[0] if failures else exc
    if isinstance(cause, UntrustedPickleError):
        raise UntrustedPickleError(str(cause)) from None


def root_cause(exc: BaseException) -> str:
    """The first rank's own error message, without torch's per-rank traceback text."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"
