"""Megatron-LM / MindSpeed-LLM legacy checkpoints, read safely, at any layout.

Layout (Megatron-LM's ``--ckpt-format torch``)::

    LOAD/
      latest_checkpointed_iteration.txt      # "release" or an iteration number
      iter_0000100/ | release/
        mp_rank_00/model_optim_rng.pt        # TP rank 00 (PP = 1)
        mp_rank_01_003/model_optim_rng.pt    # TP rank 01, PP rank 003
        mp_rank_00_000_002/...               # ... EP rank 002 (MoE with EP > 1)

Each file is a ``torch.save`` of ``{"args": argparse.Namespace, "iteration", "model":
state dict of that rank's GPTModel shard, "rng_state", "optimizer", ...}``. A pickle can
run code on load, and a checkpoint is a file from elsewhere: it is read with
``torch.load(weights_only=True)`` and an explicit allow-list for the only non-tensor
objects Megatron stores (its argument namespace and numpy's RNG state; megatron-core
also registers its own small allow-list with torch when imported: its enums, PosixPath,
BytesIO). Anything else is refused, naming the object's type.

The shards are reassembled into full tensors with the architecture's weight map (TP
concatenation that knows fused QKV and gate/up layouts, local layer and expert numbers
made global) and re-split for the layout of the model being loaded. MindSpeed-LLM's own
names for multi-latent attention (DeepSeek-V3: a fused ``linear_qkv`` down projection,
``linear_qb``/``linear_kvb``, ``--mla-mm-split`` parts) are read as megatron-core's
(``mindspeed_llm_mla.py``). Experts are read as ``local_experts.<i>`` (megatron-core's
sequential experts); grouped-GEMM ``experts.weight1``/``weight2`` are read as those
(``grouped_experts.py``). Weight buffers (the router's expert bias) are loaded with the
parameters.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from mindspeed_rl.checkpoint.megatron_dir import iteration_dir_name
from mindspeed_rl.checkpoint.tracker import TRACKER_FILE, read_tracker
from mindspeed_rl.errors import CheckpointError

MODEL_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def allowed_globals() -> list:
    """The non-tensor types a Megatron checkpoint holds: its args and the RNG states."""
    import numpy as np

    allowed = [argparse.Namespace, np.ndarray, np.dtype, np.core.multiarray._reconstruct]
    allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32", "int32",
                                            "uint8", "bool")]
    return allowed


def is_legacy_checkpoint_dir(path: str | Path) -> bool:
    """An iteration folder holding ``mp_rank_*`` sub-folders."""
    path = Path(path)
    return path.is_dir() and any(_RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir())


def legacy_iteration_dir(load: str | Path, iteration: int | None | str = "latest") -> Path:
    """The ``iter_XXXXXXX`` / ``release`` folder ``load`` points at (via its tracker file)."""
    load = Path(load)
    if iteration == "latest":
        tracker = load / TRACKER_FILE
        if not tracker.is_file():
            raise CheckpointError(f"{tracker}: missing; {load} is not a Megatron checkpoint "
                                  "directory")
        iteration = read_tracker(load)
    path = load / iteration_dir_name(iteration)
    if not is_legacy_checkpoint_dir(path):
        raise CheckpointError(f"{path}: no mp_rank_XX folders (not a legacy Megatron checkpoint)")
    return path


def read_legacy_file(path: str | Path) -> dict:
    """``torch.load`` of one ``model_optim_rng.pt`` that cannot run code.

    Raises CheckpointError naming the type when the file needs more than the allow-list.
    """
    path = Path(path)
    # Only what is not allowed already: torch's context removes its list on exit, also the
    # classes megatron-core registered for good (argparse.Namespace), which a torch_dist
    # checkpoint's common.pt read later in the process needs.
    registered = set(torch.serialization.get_safe_globals())
    try:
        with torch.serialization.safe_globals([g for g in allowed_globals() if g not in registered]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler's message names the global
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # noqa: BLE001 - unreadable as a torch zip at all
            unsafe = []
        allowed = {f"{t.__module__}.{t.__qualname__}"
                   for t in allowed_globals() + list(torch.serialization.get_safe_globals())
                   if hasattr(t, "__qualname__")}
        refused = [g for g in unsafe if g not in allowed]
        if refused:
            raise CheckpointError(
                f"{path}: holds objects of type {', '.join(refused)}, which a checkpoint "
                "loaded without running code may not contain (allowed: tensors, "
                "argparse.Namespace, numpy RNG state)") from None
        raise CheckpointError(f"{path}: cannot read: {type(exc).__name__}: {exc}") from None


def _rank_files(iteration_dir: Path) -> dict[tuple[int, int, int], Path]:
    files = {}
    for sub in iteration_dir.iterdir():
        match = _RANK_DIR.match(sub.name)
        if match and (sub / MODEL_FILE).is_file():
            tp, pp, ep = (int(g) if g is not None else 0 for g in match.groups())
            files[(tp, pp, ep)] = sub / MODEL_FILE
    if not files:
        raise CheckpointError(f"{iteration_dir}: no mp_rank_*/{MODEL_FILE} files")
    return files


def _stage_offsets(args, pp_size: int) -> list[int]:
    """Global index of the first layer of each pipeline stage the checkpoint was saved with."""
    num_layers = getattr(args, "num_layers", None)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if num_layers is None:
        raise CheckpointError("the checkpoint's args hold no num_layers")
    counts = None
    listed = getattr(args, "num_layer_list", None)
    if listed:
        counts = [int(t) for t in str(listed).split(",")]
    elif first is not None or last is not None:
        middle = num_layers - (first or 0) - (last or 0)
        inner = pp_size - (first is not None) - (last is not None)
        per = middle // max(inner, 1)
        counts = [per] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
    else:
        counts = [num_layers // pp_size] * pp_size
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def full_state_dict(iteration_dir: str | Path, weight_map, mla: dict | None = None
                    ) -> dict[str, torch.Tensor]:
    """Global megatron name -> full tensor, from every rank file of a legacy checkpoint.
    ``mla``: the model's multi-latent-attention fields, when it has MLA: MindSpeed-LLM's
    names for it are read as megatron-core's (:mod:`mindspeed_rl.checkpoint.mindspeed_llm_mla`)."""
    from mindspeed_rl.checkpoint import mindspeed_llm_mla

    files = _rank_files(Path(iteration_dir))
    tp_size = 1 + max(k[0] for k in files)
    pp_size = 1 + max(k[1] for k in files)
    shards: dict[str, dict[int, torch.Tensor]] = {}   # global name -> {tp rank: shard}
    known = set(weight_map.megatron_names())
    offsets = None
    for (tp, pp, ep), path in sorted(files.items()):
        state = read_legacy_file(path)
        if "model" not in state:
            raise CheckpointError(f"{path}: no 'model' entry (keys: {sorted(state)})")
        if offsets is None:
            offsets = _stage_offsets(state.get("args"), pp_size)
        model_state = _sequential_experts(state, path, tp_size, 1 + max(k[2] for k in files),
                                          weight_map.num_experts)
        for local, tensor in model_state.items():
            if local.endswith("_extra_state") or not isinstance(tensor, torch.Tensor):
                continue
            parts = local.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offsets[pp])
                if "local_experts" in parts:
                    k = parts.index("local_experts") + 1
                    # experts per EP rank: the shard count of this layer's expert list
                    per_rank = _experts_per_rank(model_state, local)
                    parts[k] = str(int(parts[k]) + ep * per_rank)
            name = ".".join(parts)
            if mla is not None:
                name = mindspeed_llm_mla.rename(name)
                if mindspeed_llm_mla.is_mindspeed_llm_name(name):
                    if ep == 0 and (tp == 0 or mindspeed_llm_mla.is_split_by_heads(name)):
                        shards.setdefault(name, {})[tp] = tensor  # the fused one: on every rank
                    continue
            if name not in known:   # reported by the caller, which knows the model
                shards.setdefault(name, {}).setdefault(tp, tensor)
                continue
            if not weight_map.is_expert(name) and ep != 0:
                continue   # dense weights are replicas on every EP rank
            if weight_map.tp_dim(name) is None and tp != 0:
                continue   # norms, router: replicas on every TP rank
            shards.setdefault(name, {})[tp] = tensor
    full = {}
    for name, by_rank in shards.items():
        ranks = [by_rank[r] for r in sorted(by_rank)]
        if mla is not None and mindspeed_llm_mla.is_split_by_heads(name):
            if len(ranks) != tp_size:
                raise CheckpointError(f"{iteration_dir}: {name} has {len(ranks)} of "
                                      f"{tp_size} tensor-parallel shards")
            full[name] = torch.cat(ranks, dim=0)
        elif name not in known or weight_map.tp_dim(name) is None or len(ranks) == 1:
            full[name] = ranks[0]
        else:
            if len(ranks) != tp_size:
                raise CheckpointError(f"{iteration_dir}: {name} has {len(ranks)} of "
                                      f"{tp_size} tensor-parallel shards")
            full[name] = weight_map.gather_tp(name, ranks)
    if mla is not None:
        try:
            full = mindspeed_llm_mla.combine(full, mla)
        except ValueError as error:
            raise CheckpointError(f"{iteration_dir}: {error}") from None
    return full


def _sequential_experts(state: dict, path: Path, tp_size: int, ep_size: int,
                        num_experts: int | None) -> dict:
    """The file's model state with grouped-GEMM experts as sequential ones
    (:mod:`mindspeed_rl.checkpoint.grouped_experts`)."""
    from mindspeed_rl.checkpoint import grouped_experts

    model_state = state["model"]
    if not grouped_experts.is_grouped(model_state):
        return model_state
    why = grouped_experts.refuse_layouts(state.get("args"), tp_size)
    if why is None and not num_experts:
        why = "it holds grouped-GEMM experts (mlp.experts.weight1/weight2) but the model has none"
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    try:
        return grouped_experts.expand(model_state, num_experts // ep_size)
    except RuntimeError as error:
        raise CheckpointError(f"{path}: its grouped-GEMM experts do not split into "
                              f"{num_experts // ep_size} experts per file ({num_experts} over "
                              f"EP {ep_size}): {error}") from None


def _experts_per_rank(model_state: dict, local_name: str) -> int:
    prefix = local_name.split("local_experts.")[0] + "local_experts."
    return len({k[len(prefix):].split(".")[0] for k in model_state if k.startswith(prefix)})


@torch.no_grad()
def load_legacy_megatron_checkpoint(model, arch, load: str | Path,
                                    iteration: int | None | str = "latest") -> Path:
    """Fill this rank's shard of ``model`` from a legacy checkpoint saved at any TP/PP/EP."""
    from mindspeed_rl.checkpoint import mindspeed_llm_mla
    from mindspeed_rl.models.builder import tp_rank_and_size, global_weight_names, weight_of

    path = legacy_iteration_dir(load, iteration)
    wm = arch.weight_map
    tc = arch.transformer_config_kwargs
    mla = ({k: tc.get(k) for k in mindspeed_llm_mla.MLA_FIELDS}
           if tc.get("multi_latent_attention") else None)
    full = full_state_dict(path, wm, mla)
    names = global_weight_names(model)  # parameters and weight buffers (the router's expert bias)
    missing = sorted(g for g in names.values() if g not in full)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) of the {arch.name} model are "
                              f"not in the checkpoint, e.g. {missing[:3]}")
    unexpected = sorted(set(full) - set(wm.megatron_names()))
    if unexpected:
        raise CheckpointError(f"{path}: tensor {unexpected[0]!r} is not part of a {arch.name} "
                              f"model with this config ({len(unexpected)} unexpected)")
    for local, global_name in names.items():
        param = weight_of(model, local)
        rank, size = tp_rank_and_size(wm.is_expert(global_name))
        shard = wm.split_tp(global_name, full[global_name], size)[rank] if wm.tp_dim(
            global_name) is not None else full[global_name]
        if shard.shape != param.shape:
            raise CheckpointError(f"{path}: {global_name} has shape {list(shard.shape)} for this "
                                  f"rank but the model expects {list(param.shape)}")
        param.copy_(shard.to(param.dtype))
    return path
