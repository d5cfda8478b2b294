"""Read and write HF model directories: config.json, tokenizer files, safetensors.

Errors are `CheckpointError`s naming the file and, where one is involved, the tensor.
Safetensors headers are parsed up front so a truncated or inconsistent file is refused
before any weight is converted.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable

import torch

from mindspeed_rl.errors import CheckpointError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Everything an HF directory holds besides the weights that a model user needs.
METADATA_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
    "tokenizer.model", "chat_template.jinja", "chat_template.json",
)

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def load_hf_config(hf_dir: str | os.PathLike):
    """The transformers config of an HF directory (CheckpointError when missing or unreadable)."""
    from transformers import AutoConfig

    path = Path(hf_dir) / CONFIG_FILE
    if not Path(hf_dir).is_dir():
        raise CheckpointError(f"{hf_dir}: not a directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; an HF model directory needs its config.json")
    try:
        return AutoConfig.from_pretrained(str(hf_dir))
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; name the file
        raise CheckpointError(f"{path}: cannot be read as a transformers config ({exc})") from exc


def _read_header(path: Path) -> dict:
    """Parse one safetensors header and check every tensor's bytes lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise CheckpointError(
                f"{path}: truncated safetensors file: the header declares {header_len} bytes "
                f"but the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if end > data_bytes:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name!r} needs bytes {begin}..{end} of "
                f"the data section but it has only {data_bytes}"
            )
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return header


class HFCheckpointReader:
    """Lazy, validated access to the tensors of an HF directory (single file or sharded)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        self.config = load_hf_config(self.dir)
        self._file_of: dict[str, Path] = {}
        self._info: dict[str, dict] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
            paths = [self.dir / f for f in files]
        else:
            paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(
                f"{self.dir}: no *.safetensors weights (pytorch_model.bin checkpoints are not "
                "read; re-save the model with safe_serialization)"
            )
        for path in paths:
            if not path.is_file():
                raise CheckpointError(f"{path}: listed in {INDEX_FILE} but missing")
            for name, info in _read_header(path).items():
                self._file_of[name] = path
                self._info[name] = info
        self._handles: dict[Path, object] = {}
        self._init_fp8()

    def _init_fp8(self) -> None:
        """An FP8 block-quantised checkpoint (`mindspeed_rl.models.fp8_weights`): each FP8
        weight reads as its bf16 dequantisation; the ``*_scale_inv`` tensors are not listed."""
        from mindspeed_rl.models import fp8_weights

        self._fp8_block = fp8_weights.block_size(self.config)
        self._fp8_scales: dict[str, str] = {}  # weight -> its scale tensor
        if self._fp8_block is None:
            return
        suffix = fp8_weights.SCALE_SUFFIX
        for name in self._file_of:
            if name.endswith(suffix) and name[: -len(suffix)] in self._file_of:
                self._fp8_scales[name[: -len(suffix)]] = name
        for name in self._file_of:
            if self.raw_dtype(name) in fp8_weights.FP8_DTYPES and name not in self._fp8_scales:
                raise CheckpointError(f"{self._file_of[name]}: FP8 tensor {name!r} has no "
                                      f"{name + suffix!r} (block scales) in the safetensors files")

    def names(self) -> list[str]:
        hidden = set(self._fp8_scales.values())
        return [n for n in self._file_of if n not in hidden]

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def raw_dtype(self, name: str) -> torch.dtype:
        """The dtype stored in the file."""
        return _ST_DTYPES[self._info[name]["dtype"]]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype `get` returns (bf16 for a dequantised FP8 weight)."""
        return torch.bfloat16 if name in self._fp8_scales else self.raw_dtype(name)

    def get(self, name: str) -> torch.Tensor:
        """One tensor (an FP8 block-quantised weight dequantised to bf16)."""
        if name in self._fp8_scales:
            from mindspeed_rl.models import fp8_weights

            weight, scale = self._get_raw(name), self._get_raw(self._fp8_scales[name])
            try:
                return fp8_weights.dequantize(weight, scale, self._fp8_block)
            except ValueError as exc:
                raise CheckpointError(f"{self._file_of[name]}: tensor {name!r}: {exc}") from exc
        return self._get_raw(name)

    def _get_raw(self, name: str) -> torch.Tensor:
        """One tensor as stored, read from its file."""
        from safetensors import safe_open

        if name not in self._file_of:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the safetensors files")
        path = self._file_of[name]
        try:
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(str(path), framework="pt")
            return handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors errors carry no file name
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from exc


def copy_metadata_files(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy config, generation config and tokenizer files; return the names copied."""
    copied = []
    for name in METADATA_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(dst_dir) / name)
            copied.append(name)
    return copied


def drop_fp8_quantization(config_path: str | os.PathLike) -> bool:
    """Remove an FP8 ``quantization_config`` from a copied config.json whose weights were
    written dequantised (`HFCheckpointReader` reads FP8 checkpoints as bf16). True if removed."""
    path = Path(config_path)
    config = json.loads(path.read_text())
    if (config.get("quantization_config") or {}).get("quant_method") != "fp8":
        return False
    del config["quantization_config"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return True


def write_safetensors(out_dir: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
                      *, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write named tensors as HF safetensors (one file, or shards plus an index).

    Tensors arrive as a stream so at most one shard is held at a time.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    files: list[str] = []
    weight_map: dict[str, str] = {}
    shard_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal shard_bytes
        if not shards[-1]:
            return
        # Shard names need the total count, unknown while streaming: write with a
        # placeholder and rename once the count is known.
        name = f"model-{len(files) + 1:05d}.safetensors.partial"
        save_file(shards[-1], str(out_dir / name), metadata={"format": "pt"})
        files.append(name)
        for t in shards[-1]:
            weight_map[t] = name
        shards[-1] = {}
        shard_bytes = 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shards[-1][name] = tensor.contiguous()
        shard_bytes += nbytes
        total += nbytes
    flush()

    if len(files) == 1:
        os.replace(out_dir / files[0], out_dir / SINGLE_FILE)
        return [SINGLE_FILE]
    final = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
    for partial, name in final.items():
        os.replace(out_dir / partial, out_dir / name)
    index = {"metadata": {"total_size": total},
             "weight_map": {t: final[f] for t, f in sorted(weight_map.items())}}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return list(final.values())

