"""Checkpoint conversion: HF <-> megatron distributed checkpoint, and GGUF -> either.

The megatron side is built whole (TP=PP=EP=1) in one process; the distributed
checkpoint it writes stores global tensors, so it loads at any TP/PP/EP layout.
Every conversion writes into a temporary directory renamed at the end
(`staging.staged_output_dir`), so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch

from mindspeed_rl.checkpoint.gguf import find_gguf_file, gguf_to_hf_dir
from mindspeed_rl.checkpoint.lora_export import keys_have_adapters
from mindspeed_rl.checkpoint.megatron_dir import (
    checkpoint_tensor_keys, load_megatron_checkpoint, read_meta, save_megatron_checkpoint, write_meta,
)
from mindspeed_rl.checkpoint.staging import check_output_dir, staged_output_dir
from mindspeed_rl.errors import CheckpointError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _progress(desc: str, enabled: bool):
    from tqdm import tqdm

    return lambda items: tqdm(items, desc=desc, unit="tensor", disable=not enabled, leave=False)


@contextlib.contextmanager
def whole_model_parallel_state(seed: int = 1234) -> Iterator[None]:
    """A 1-rank gloo group and megatron state with TP=PP=EP=1 (reuses a 1-rank group if present)."""
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    owned = not dist.is_initialized()
    tmp = None
    if owned:
        tmp = tempfile.mkdtemp(prefix="msrl_convert_")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("checkpoint conversion runs in one process; launch it without torchrun")
    try:
        initialize_megatron_parallel(ParallelLayout(world_size=1), seed=seed)
        try:
            yield
        finally:
            destroy_megatron_parallel()
    finally:
        if owned:
            dist.destroy_process_group()
            shutil.rmtree(tmp, ignore_errors=True)


def _hf_dir_to_mg_dir(hf_dir: Path, out_dir: Path, show_progress: bool) -> None:
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader, copy_metadata_files, drop_fp8_quantization
    from mindspeed_rl.models.registry import describe_model
    from mindspeed_rl.models.value_head import (
        SCORE, build_value_model, is_sequence_classification, load_value_weights_from_hf,
    )

    reader = HFCheckpointReader(hf_dir)  # validates config.json and every safetensors header
    arch = describe_model(reader.config)
    # A sequence-classification checkpoint (reward model) becomes a scalar-head model.
    scalar_head = SCORE in reader or is_sequence_classification(reader.config)
    progress = _progress("hf -> megatron", show_progress)
    with whole_model_parallel_state():
        config = build_transformer_config(arch, perform_initialization=False)
        if scalar_head:
            model = build_value_model(arch, config)
            load_value_weights_from_hf(model, arch, reader, require_score_head=True, progress=progress)
        else:
            model = build_gpt_model(arch, config)
            load_hf_weights(model, arch, reader, progress=progress)
        copy_metadata_files(hf_dir, out_dir)
        drop_fp8_quantization(out_dir / "config.json")  # FP8 weights were read dequantised
        head = {"head": "score", "num_labels": 1} if scalar_head else {}
        write_meta(out_dir, arch.name, padded_vocab_size=arch.padded_vocab_size, source=str(hf_dir), **head)
        save_megatron_checkpoint(model, out_dir, iteration=None)


def convert_hf_to_mg(hf_dir, save_dir, *, overwrite: bool = False, show_progress: bool = False) -> Path:
    """HF directory -> megatron checkpoint directory (loads at any TP/PP/EP layout)."""
    with staged_output_dir(save_dir, overwrite) as out:
        _hf_dir_to_mg_dir(Path(hf_dir), out, show_progress)
    return Path(save_dir)


def convert_mg_to_hf(mg_dir, save_dir, *, overwrite: bool = False, dtype: str = "auto",
                     show_progress: bool = False, hf_config_dir=None,
                     lora_adapter_dir=None) -> Path:
    """Megatron checkpoint directory -> HF directory (config, tokenizer files, safetensors).

    The checkpoint is one written here (converted or trained; it carries config.json), or
    a Megatron-LM / MindSpeed-LLM one (``torch_dist``, or legacy ``mp_rank_XX`` files saved
    at any TP/PP/EP), whose architecture comes from ``hf_config_dir`` (the model's HF
    directory: config.json and tokenizer files). ``dtype="auto"`` writes the dtype
    config.json names (float32 if none). A checkpoint with a scalar head
    (``value_head.weight``) is written as ``*ForSequenceClassification`` (``score.weight``);
    an LM config.json (a critic started from a CausalLM) is rewritten for that class
    (`as_sequence_classification`). A LoRA checkpoint is written merged (W + alpha/r B A;
    an adapter-only one on the base model it recorded), and with ``lora_adapter_dir`` its
    adapters also in PEFT's format (`mindspeed_rl.checkpoint.lora_export`).
    """
    from mindspeed_rl.checkpoint.weight_source import classify, load_weights
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config, hf_tensors_from_model
    from mindspeed_rl.models.hf_io import (copy_metadata_files, drop_fp8_quantization, load_hf_config,
                                           write_safetensors)
    from mindspeed_rl.models.registry import describe_model
    from mindspeed_rl.models.value_head import (
        VALUE_HEAD, build_value_model, is_sequence_classification, value_architecture,
    )

    mg_dir = Path(mg_dir)
    check_output_dir(save_dir, overwrite)
    config_dir = Path(hf_config_dir) if hf_config_dir else mg_dir
    if not (config_dir / "config.json").is_file():
        raise CheckpointError(
            f"{mg_dir} has no config.json (a Megatron-LM / MindSpeed-LLM checkpoint does not "
            "carry one): pass --hf-config-dir with the model's HF directory")
    arch = describe_model(load_hf_config(config_dir))
    if hf_config_dir is None:
        meta = read_meta(mg_dir)
        if arch.name != meta["architecture"]:
            raise CheckpointError(
                f"{mg_dir}/config.json describes {arch.name} but the checkpoint was written for "
                f"{meta['architecture']}"
            )
    source = classify(mg_dir, "--load-dir")
    keys = (checkpoint_tensor_keys(mg_dir, source.iteration)
            if source.kind == "megatron_dist" else set())
    scalar_head = VALUE_HEAD in keys
    lora = keys_have_adapters(keys)
    if lora_adapter_dir is not None:
        if not lora:
            raise CheckpointError(f"--lora-adapter-dir: {mg_dir} holds no LoRA adapters")
        check_output_dir(lora_adapter_dir, overwrite)
    if dtype == "auto":
        out_dtype = getattr(arch.hf_config, "dtype", None) or getattr(arch.hf_config, "torch_dtype", None)
        out_dtype = _DTYPES.get(str(out_dtype).replace("torch.", ""), torch.float32)
    else:
        out_dtype = _DTYPES[dtype]
    with staged_output_dir(save_dir, overwrite) as out:
        with whole_model_parallel_state():
            config = build_transformer_config(arch, perform_initialization=False)
            if scalar_head:
                arch = value_architecture(arch)
                model = build_value_model(arch, config)
            else:
                model = build_gpt_model(arch, config)
            if lora:
                _load_merged_lora(model, arch, source, lora_adapter_dir)
            else:
                load_weights(model, arch, source)
            tensors = hf_tensors_from_model(model, arch, dtype=out_dtype)
            if show_progress:
                total = len(arch.weight_map.all_hf_names())
                from tqdm import tqdm

                tensors = tqdm(tensors, total=total, desc="megatron -> hf", unit="tensor", leave=False)
            write_safetensors(out, tensors)
        copy_metadata_files(config_dir, out)
        drop_fp8_quantization(out / "config.json")
        if scalar_head and not is_sequence_classification(arch.hf_config):
            as_sequence_classification(out / "config.json")
    return Path(save_dir)


def _load_merged_lora(model, arch, source, adapter_dir) -> None:
    """Rebuild the LoRA model of ``source``, write its PEFT adapter if asked, then merge."""
    from mindspeed_rl.checkpoint.lora_export import load_lora_model, write_peft_adapter
    from mindspeed_rl.models.lora import merge_adapters

    lora = load_lora_model(model, arch, source)
    if lora["regrouped"]:
        print(f"{source.path}: an older LoRA checkpoint: linear_fc1's lora_B of "
              f"{lora['regrouped']} layers regrouped from the rank-interleaved layout it was "
              "saved in to [gate; up]", file=sys.stderr)
    if adapter_dir is not None:
        base = lora.get("base") or {}
        with staged_output_dir(adapter_dir, True) as out:
            write_peft_adapter(model, arch, out, lora,
                               base.get("path") if base.get("kind") == "hf" else None)
    merge_adapters(model)


def as_sequence_classification(config_path: Path) -> None:
    """Rewrite an LM's config.json for its ``*ForSequenceClassification`` twin with one label.

    A critic trained from a CausalLM keeps that config; transformers needs the class
    name and ``num_labels=1`` to load the score head.
    """
    config = json.loads(config_path.read_text())
    names = config.get("architectures") or []
    if not names or not names[0].endswith("ForCausalLM"):
        raise CheckpointError(f"{config_path}: \"architectures\"={names} names no *ForCausalLM class to "
                              "turn into *ForSequenceClassification; set it by hand")
    config["architectures"] = [names[0][: -len("ForCausalLM")] + "ForSequenceClassification"]
    config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert_gguf(load_dir, save_dir, save_model_type: str, *, gguf_file: str | None = None,
                 overwrite: bool = False, show_progress: bool = False) -> Path:
    """GGUF (dequantised by transformers) -> HF directory or megatron checkpoint directory."""
    path = find_gguf_file(load_dir, gguf_file)
    with staged_output_dir(save_dir, overwrite) as out:
        if save_model_type == "hf":
            gguf_to_hf_dir(path, out)
        else:
            with tempfile.TemporaryDirectory(prefix=".gguf-hf-", dir=out) as hf_tmp:
                gguf_to_hf_dir(path, Path(hf_tmp))
                _hf_dir_to_mg_dir(Path(hf_tmp), out, show_progress)
    return Path(save_dir)


def convert(load_model_type: str, save_model_type: str, load_dir, save_dir, *,
            overwrite: bool = False, gguf_file: str | None = None, dtype: str = "auto",
            show_progress: bool = False, hf_config_dir=None, lora_adapter_dir=None) -> Path:
    """Dispatch on (load type, save type); see tools/convert_ckpt.py."""
    pair = (load_model_type, save_model_type)
    if pair == ("hf", "mg"):
        return convert_hf_to_mg(load_dir, save_dir, overwrite=overwrite, show_progress=show_progress)
    if pair == ("mg", "hf"):
        return convert_mg_to_hf(load_dir, save_dir, overwrite=overwrite, dtype=dtype,
                                show_progress=show_progress, hf_config_dir=hf_config_dir,
                                lora_adapter_dir=lora_adapter_dir)
    if load_model_type == "gguf" and save_model_type in ("hf", "mg"):
        return convert_gguf(load_dir, save_dir, save_model_type, gguf_file=gguf_file,
                            overwrite=overwrite, show_progress=show_progress)
    raise ValueError(f"cannot convert {load_model_type} -> {save_model_type}; supported: hf->mg, "
                     "mg->hf, gguf->hf, gguf->mg")
