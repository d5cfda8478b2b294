"""Write a Megatron-LM legacy checkpoint (``--ckpt-format torch``) the way Megatron-LM does.

Each rank of a TP x PP layout saves ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` =
``torch.save({"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
"model": model.state_dict_for_save_checkpoint(), "rng_state": [...], "optimizer": ...,
"opt_param_scheduler": ...})`` and rank 0 writes ``latest_checkpointed_iteration.txt``.
The model is a megatron-core GPTModel filled from a tiny HF directory, so the checkpoint
holds known weights. Test helper only.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


@contextlib.contextmanager
def _model_at_layout(hf_dir: str, tp: int, pp: int):
    """This rank's megatron GPTModel of ``hf_dir`` at TP x PP, its weights loaded; the
    process groups are torn down on exit."""
    from mindspeed_rl.models.builder import build_model_from_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(world_size=dist.get_world_size(),
                                                tensor_model_parallel_size=tp,
                                                pipeline_model_parallel_size=pp))
    try:
        model, arch, config = build_model_from_hf_dir(hf_dir)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        yield model, config
    finally:
        destroy_megatron_parallel()


def save_legacy_checkpoint(hf_dir: str, out_dir: str, tp: int, pp: int, iteration: int,
                           extra_args: dict | None = None) -> None:
    """Run on every rank of a TP x PP world (e.g. through run_on_ranks)."""
    with _model_at_layout(hf_dir, tp, pp) as (model, config):
        write_rank_file(model.state_dict_for_save_checkpoint(), config, out_dir, iteration,
                        extra_args)


def write_rank_file(model_state: dict, config, out_dir: str, iteration: int,
                    extra_args: dict | None = None) -> None:
    """This rank's ``model_optim_rng.pt`` with ``model_state``, in megatron's current layout;
    rank 0 writes the tracker file. Every rank calls it."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    args = argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, params_dtype=torch.float32, iteration=iteration,
        consumed_train_samples=iteration * 8, tokenizer_type="PretrainedFromHF",
        data_path=["./dataset/data"], **(extra_args or {}))
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
           "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model_state, "rng_state": [rng],
             "optimizer": {"optimizer": {"state": {}, "param_groups": []}},
             "opt_param_scheduler": {"num_steps": iteration * 8}}
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    folder = Path(out_dir) / f"iter_{iteration:07d}" / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def mindspeed_llm_mla_state(model, config, style: str) -> dict:
    """This rank's state dict of an MLA ``model`` (TP x EP 1 x PP 1) under MindSpeed-LLM's
    names, as its converter (mindspeed_llm/tasks/checkpoint/convert_hf2mg.py) lays them
    out: the query and key/value down projections fused along rows into ``linear_qkv``,
    the full tensor on every TP rank; the up projections split by heads over TP, as
    ``linear_qb``/``linear_kvb`` with ``k_layernorm`` (``style="older"``) or, with
    ``--mla-mm-split`` (``style="mm_split"``), as their per-head parts ``linear_qk_nope``,
    ``linear_qk_rope``, ``linear_kv_nope``, ``linear_v`` with ``kv_layernorm``;
    ``style="grouped_gemm"``: "older" with the experts as ``--moe-grouped-gemm`` saves them."""
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    heads = config.num_attention_heads // tp
    qk, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim

    def full_rows(t):  # megatron-core splits the down projections' rows over TP
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    out, state = {}, model.state_dict_for_save_checkpoint()
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue  # megatron's _extra_state entries (None here); the reader skips them
        pre, sep, rest = name.partition("self_attention.")
        module = rest.split(".")[0] if sep else None
        tail = rest[len(module or ""):] if sep else ""
        if module == "linear_q_down_proj":
            kv = state[name.replace("linear_q_down_proj", "linear_kv_down_proj")]
            out[pre + sep + "linear_qkv" + tail] = torch.cat([full_rows(t), full_rows(kv)])
        elif module == "linear_kv_down_proj":
            continue
        elif module in ("linear_q_up_proj", "linear_kv_up_proj") and style == "mm_split":
            widths = (qk, rope) if module == "linear_q_up_proj" else (qk, v)
            names = (("linear_qk_nope", "linear_qk_rope") if module == "linear_q_up_proj"
                     else ("linear_kv_nope", "linear_v"))
            a, b = t.reshape(heads, sum(widths), -1).split(list(widths), dim=1)
            out[pre + sep + names[0] + tail] = a.reshape(heads * widths[0], -1).clone()
            out[pre + sep + names[1] + tail] = b.reshape(heads * widths[1], -1).clone()
        elif module in ("linear_q_up_proj", "linear_kv_up_proj", "kv_layernorm") and style != "mm_split":
            older = {"linear_q_up_proj": "linear_qb", "linear_kv_up_proj": "linear_kvb",
                     "kv_layernorm": "k_layernorm"}[module]
            out[pre + sep + older + tail] = t
        else:
            out[name] = t
    return grouped_gemm_experts(out) if style == "grouped_gemm" else out


def grouped_gemm_experts(state: dict) -> dict:
    """``state`` with each MoE layer's sequential experts as MindSpeed-LLM's grouped-GEMM
    pair (``--moe-grouped-gemm``, local implementation; its convert_hf2mg.py layout):
    ``mlp.experts.weight1`` = the [E, hidden, r] stack of the experts' linear_fc1 shards
    transposed, reshaped to [hidden, E * r]; ``weight2`` = the [E, c, hidden] stack of their
    linear_fc2 shards transposed, reshaped to [E * c, hidden]."""
    import re

    expert = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
    out, stacks = {}, {}
    for name, t in state.items():
        m = expert.match(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault((m[1], m[3]), {})[int(m[2])] = t.t()
    for (prefix, fc), by_index in stacks.items():
        stack = torch.stack([by_index[j] for j in sorted(by_index)])
        if fc == "linear_fc1":
            out[prefix + "weight1"] = stack.reshape(stack.shape[1], -1).clone()
        else:
            out[prefix + "weight2"] = stack.reshape(-1, stack.shape[2]).clone()
    return out


def save_torch_dist_checkpoint(hf_dir: str, out_dir: str, tp: int, pp: int,
                               iteration: int) -> None:
    """Megatron-LM's ``--ckpt-format torch_dist``: dist_checkpointing.save of the model's
    sharded state dict plus args, iteration and version in common.pt; run on every rank."""
    with _model_at_layout(hf_dir, tp, pp) as (model, config):
        args = argparse.Namespace(num_layers=config.num_layers, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, ckpt_format="torch_dist")
        _save_torch_dist(model.sharded_state_dict(), args, out_dir, iteration)


def _save_torch_dist(sharded_state: dict, args: argparse.Namespace, out_dir: str,
                     iteration: int) -> None:
    """``iter_NNNNNNN/`` of ``out_dir`` as Megatron-LM writes it with torch_dist (the model's
    sharded state, args, iteration and version in common.pt) and the tracker file; collective."""
    from megatron.core import dist_checkpointing

    folder = Path(out_dir) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": sharded_state, "args": args, "iteration": iteration,
                             "checkpoint_version": 3.0}, str(folder))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def save_mindspeed_llm_torch_dist(model, config, style: str, out_dir: str, iteration: int) -> None:
    """``model`` (an MLA model at TP x PP 1, DP 1) saved as MindSpeed-LLM saves it with
    ``--ckpt-format torch_dist``: megatron-core's sharded state dict of its own MLA modules
    (mindspeed_llm/tasks/models/transformer/multi_latent_attention.py): the fused down
    projection ``linear_qkv`` is a plain ``torch.nn.Linear`` (``LinearNoTP``), whole and
    replicated over TP, without ``_extra_state``; its up projections are column-parallel,
    as ``linear_qb``/``linear_kvb`` with ``k_layernorm`` (``style="older"``) or the
    ``--mla-mm-split`` parts (``style="mm_split"``). Run on every rank."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    heads = config.num_attention_heads // tp
    widths = {"linear_q_up_proj": (config.qk_head_dim, config.qk_pos_emb_head_dim),
              "linear_kv_up_proj": (config.qk_head_dim, config.v_head_dim)}
    parts = {"linear_q_up_proj": ("linear_qk_nope", "linear_qk_rope"),
             "linear_kv_up_proj": ("linear_kv_nope", "linear_v")}
    older = {"linear_q_up_proj": "linear_qb", "linear_kv_up_proj": "linear_kvb", "kv_layernorm": "k_layernorm"}

    def full_rows(t):
        shards = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(shards, t.contiguous(), group=group)
        return torch.cat(shards)

    state = model.sharded_state_dict()
    out = {}
    for key, sh in state.items():
        pre, sep, rest = sh.key.partition("self_attention.")
        module = rest.split(".")[0] if sep else None
        tail = rest[len(module or ""):]
        # megatron-core stacks the layers along a first axis, or, for models whose layers
        # differ (DeepSeek-V3's dense first layers), keeps one key per layer.
        p = getattr(sh, "prepend_axis_num", 0)
        layer = [(i, sh.global_offset[i], sh.global_shape[i]) for i in range(p)]
        if module in ("linear_q_down_proj", "linear_kv_down_proj") and key.endswith("._extra_state"):
            continue   # LinearNoTP keeps none
        if module == "linear_q_down_proj":
            kv = state[key.replace("linear_q_down_proj", "linear_kv_down_proj")]
            fused = torch.cat([full_rows(sh.data), full_rows(kv.data)])
            out[key.replace("linear_q_down_proj", "linear_qkv")] = ShardedTensor.from_rank_offsets(
                pre + sep + "linear_qkv" + tail, fused, *layer, replica_id=(0, rank, 0), prepend_axis_num=p)
        elif module == "linear_kv_down_proj":
            continue
        elif module in parts and style == "mm_split":
            for name, part in zip(parts[module], range(2)):
                if key.endswith("._extra_state"):
                    out[key.replace(module, name)] = dataclasses.replace(sh, key=pre + sep + name + tail)
                    continue
                a = sh.data.reshape(heads, sum(widths[module]), -1).split(list(widths[module]), dim=1)[part]
                out[key.replace(module, name)] = ShardedTensor.from_rank_offsets(
                    pre + sep + name + tail, a.reshape(heads * widths[module][part], -1).clone(), *layer,
                    (p, rank, tp), replica_id=sh.replica_id, prepend_axis_num=p)
        elif module in older and style == "older":
            out[key.replace(module, older[module])] = dataclasses.replace(sh, key=pre + sep + older[module] + tail)
        else:
            out[key] = sh
    args = argparse.Namespace(num_layers=config.num_layers, tensor_model_parallel_size=tp,
                              multi_latent_attention=True, ckpt_format="torch_dist")
    _save_torch_dist(out, args, out_dir, iteration)
