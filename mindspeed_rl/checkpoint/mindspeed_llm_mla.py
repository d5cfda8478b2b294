"""MindSpeed-LLM's names for multi-latent attention (DeepSeek-V3) in its Megatron checkpoints,
read as megatron-core's.

MindSpeed-LLM (``mindspeed_llm/tasks/checkpoint``) saves an MLA layer's attention under names
of its own where megatron-core has ``linear_q_down_proj``, ``linear_kv_down_proj``,
``linear_q_up_proj``, ``linear_kv_up_proj`` and ``kv_layernorm``:

==========================================  ===========================================  ======
MindSpeed-LLM                               megatron-core (here)                         TP
==========================================  ===========================================  ======
``linear_qkv``: [q down; kv down] rows      ``linear_q_down_proj`` (``linear_q_proj``    full on
(HF ``q_a_proj`` or ``q_proj``, then        without ``q_lora_rank``),                    every
``kv_a_proj_with_mqa``)                     ``linear_kv_down_proj``                      rank
``linear_qb`` (older) / ``linear_q_up_proj``  ``linear_q_up_proj``                       heads
``linear_kvb`` (older) / ``linear_kv_up_proj``  ``linear_kv_up_proj``                    heads
``k_layernorm`` (older) / ``kv_layernorm``  ``kv_layernorm``                             full
``--mla-mm-split``: ``linear_qk_nope`` +    ``linear_q_up_proj`` (per head: nope rows,   heads
``linear_qk_rope``; ``linear_kv_nope`` +    then rope rows); ``linear_kv_up_proj`` (per
``linear_v``                                head: key rows, then value rows)
==========================================  ===========================================  ======

``rename`` maps a tensor's name as it is read, :data:`SPLIT_BY_HEADS` names the parts whose TP
shards are concatenated along rows, and ``combine`` turns the full fused and split tensors
into megatron-core's (pure functions of full, TP-gathered tensors). Legacy checkpoints
(``model_optim_rng.pt`` per rank) are read through them by ``legacy_megatron.py``;
``torch_dist`` checkpoints (``--ckpt-format torch_dist``, where each global tensor is stored
once under its name: the layers stacked along a first axis, or one key per layer when the
layers differ, as DeepSeek-V3's dense and MoE layers do) through ``torch_dist_request``, which
asks megatron-core's loader for MindSpeed-LLM's tensors of each layer whole and cuts this
rank's shards of megatron-core's out of them.
"""

from __future__ import annotations

from typing import Callable

import torch

# MLATransformerConfig's fields that fix the shapes of the MLA tensors (``combine``'s ``dims``).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "num_attention_heads")

_ATTN = "self_attention."
RENAMED = {"linear_qb": "linear_q_up_proj", "linear_kvb": "linear_kv_up_proj",
           "k_layernorm": "kv_layernorm"}
FUSED_DOWN = "linear_qkv"
SPLIT_BY_HEADS = ("linear_qk_nope", "linear_qk_rope", "linear_kv_nope", "linear_v")


def _module(name: str) -> str | None:
    """The attention module a layer tensor belongs to (``linear_qb`` of
    ``decoder.layers.3.self_attention.linear_qb.weight``), else None."""
    head, sep, tail = name.partition(_ATTN)
    return tail.split(".")[0] if sep else None


def rename(name: str) -> str:
    """MindSpeed-LLM's older names for the same tensors: megatron-core's."""
    module = _module(name)
    if module in RENAMED:
        return name.replace(_ATTN + module + ".", _ATTN + RENAMED[module] + ".", 1)
    return name


def is_split_by_heads(name: str) -> bool:
    """A ``--mla-mm-split`` part: its TP shards are whole heads, concatenated along rows."""
    return _module(name) in SPLIT_BY_HEADS


def is_mindspeed_llm_name(name: str) -> bool:
    """A tensor only MindSpeed-LLM's MLA has (``combine`` turns it into megatron-core's)."""
    return _module(name) in SPLIT_BY_HEADS + (FUSED_DOWN,)


def combine(full: dict[str, torch.Tensor], dims: dict) -> dict[str, torch.Tensor]:
    """``full`` with MindSpeed-LLM's fused down projection and ``--mla-mm-split`` parts
    turned into megatron-core's tensors. ``dims``: the model's MLA fields
    (``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``,
    ``v_head_dim``, ``num_attention_heads``: ``MLATransformerConfig``'s)."""
    heads = int(dims["num_attention_heads"])
    qk, rope, v = int(dims["qk_head_dim"]), int(dims["qk_pos_emb_head_dim"]), int(dims["v_head_dim"])
    q_rows = int(dims["q_lora_rank"]) if dims.get("q_lora_rank") else heads * (qk + rope)
    q_name = "linear_q_down_proj" if dims.get("q_lora_rank") else "linear_q_proj"
    kv_rows = int(dims["kv_lora_rank"]) + rope
    out = {}
    for name, tensor in full.items():
        module = _module(name)
        prefix = name.split(_ATTN)[0] + _ATTN if module else ""
        suffix = name[len(prefix) + len(module or ""):] if module else ""
        if module == FUSED_DOWN:
            if tensor.shape[0] != q_rows + kv_rows:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, but MindSpeed-LLM's fused MLA "
                                 f"down projection of this model has {q_rows} (query) + "
                                 f"{kv_rows} (kv_lora_rank + qk_pos_emb_head_dim)")
            out[prefix + q_name + suffix], out[prefix + "linear_kv_down_proj" + suffix] = (
                t.clone() for t in tensor.split([q_rows, kv_rows]))
        elif module in ("linear_qk_nope", "linear_kv_nope"):
            first, second, widths, target = (
                ("linear_qk_nope", "linear_qk_rope", (qk, rope), "linear_q_up_proj")
                if module == "linear_qk_nope" else
                ("linear_kv_nope", "linear_v", (qk, v), "linear_kv_up_proj"))
            other = prefix + second + suffix
            if other not in full:
                raise ValueError(f"{name} without {other}: a --mla-mm-split checkpoint holds both")
            a, b = tensor, full[other]
            out[prefix + target + suffix] = torch.cat(
                [a.reshape(heads, widths[0], -1), b.reshape(heads, widths[1], -1)], dim=1
            ).reshape(heads * sum(widths), -1)
        elif module not in ("linear_qk_rope", "linear_v"):
            out[name] = tensor
    return out


# megatron-core's MLA modules, and the MindSpeed-LLM modules each is made from: the first
# option whose tensors the checkpoint holds is read.
_SOURCES = {
    "linear_q_down_proj": ((FUSED_DOWN,),),
    "linear_q_proj": ((FUSED_DOWN,),),
    "linear_kv_down_proj": ((FUSED_DOWN,),),
    "linear_q_up_proj": (("linear_qb",), ("linear_qk_nope", "linear_qk_rope")),
    "linear_kv_up_proj": (("linear_kvb",), ("linear_kv_nope", "linear_v")),
    "kv_layernorm": (("k_layernorm",),),
}


def _with_module(name: str, module: str) -> str:
    """``name`` (an attention tensor's) with its module replaced by ``module``."""
    head, sep, tail = name.partition(_ATTN)
    return head + sep + module + tail[len(tail.split(".")[0]):]


def torch_dist_request(request: dict, stored: dict, dims: dict
                       ) -> tuple[dict, Callable[[dict], dict]]:
    """A ``dist_checkpointing.load`` request for a ``torch_dist`` checkpoint that stores
    MindSpeed-LLM's MLA tensors, from ``request`` (the model's sharded state dict, under
    megatron-core's names).

    ``stored``: the checkpoint's tensor metadata (``dist_checkpointing.load_tensors_metadata``:
    checkpoint key -> a ShardedTensor without data, of the global shape and stored dtype). Each requested MLA tensor the checkpoint does not hold
    under its own key is replaced by requests of the MindSpeed-LLM tensors of its layer it is
    made from, whole (the fused down projection is not sharded; an up projection's parts are
    taken on every TP rank); ``dims``: :data:`MLA_FIELDS`. The megatron ``_extra_state`` of
    such a module (None for non-TE linears) is not read. Returns the request and ``finish``,
    which turns the loaded state back into the model's keys and this rank's shards.
    Everything the checkpoint holds as it is passes unchanged."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    asked, derived, dropped, sources = {}, {}, [], {}
    for key, sh in request.items():
        module = _module(getattr(sh, "key", ""))
        options = _SOURCES.get(module, ())
        if options and key.endswith("._extra_state"):
            weight = sh.key.replace("._extra_state", ".weight")
            if weight not in stored and any(
                    all(_with_module(weight, m) in stored for m in o) for o in options):
                dropped.append(key)
                continue
        if not isinstance(sh, ShardedTensor) or sh.key in stored or not options:
            asked[key] = sh
            continue
        option = next((o for o in options if all(_with_module(sh.key, m) in stored for m in o)), None)
        if option is None or sh.flattened_range is not None:
            asked[key] = sh  # megatron's load names the missing tensor
            continue
        p = sh.prepend_axis_num
        for source in option:
            stored_key = _with_module(sh.key, source)
            name = _with_module(key, source)
            if name not in sources:
                meta = stored[stored_key]
                data = torch.empty(meta.global_shape[p:], dtype=meta.dtype)
                # Every rank holding the layer asks for the whole tensor; the one whose own
                # shard is the first main replica is the main one (megatron checks that each
                # element has exactly one).
                first = is_main_replica(sh.replica_id) and not any(sh.global_offset[p:])
                sources[name] = ShardedTensor.from_rank_offsets(
                    stored_key, data, *[(i, sh.global_offset[i], meta.global_shape[i]) for i in range(p)],
                    replica_id=0 if first else 1, prepend_axis_num=p)
        derived[key] = sh
    asked.update(sources)

    def finish(state: dict) -> dict:
        full = {rename(name): state.pop(name) for name in sources}
        made = combine(full, dims)
        for key, sh in derived.items():
            whole = made[key]
            p = sh.prepend_axis_num
            if tuple(whole.shape) != tuple(sh.global_shape[p:]):
                raise ValueError(f"{sh.key}: MindSpeed-LLM's tensors make a {tuple(whole.shape)} "
                                 f"tensor, the model's is {tuple(sh.global_shape[p:])}")
            region = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[p:], sh.local_shape))
            state[key] = whole[region].to(sh.dtype)
        state.update(dict.fromkeys(dropped))
        return state

    return asked, finish
