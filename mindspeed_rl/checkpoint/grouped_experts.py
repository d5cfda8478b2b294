"""Grouped-GEMM experts in Megatron-LM / MindSpeed-LLM legacy checkpoints, read as
megatron-core's sequential experts (``local_experts.<j>.linear_fc1`` / ``linear_fc2``).

With ``--moe-grouped-gemm`` and the local transformer implementation, a rank file holds one
pair per MoE layer for its ``E`` local experts (MindSpeed-LLM's converter,
``mindspeed_llm/tasks/checkpoint/convert_hf2mg.py``, lays them out so):

- ``mlp.experts.weight1`` [hidden, E * r]: the [E, hidden, r] stack of each expert's
  ``linear_fc1`` TP shard transposed (r rows: the shard's gate rows, then its up rows);
- ``mlp.experts.weight2`` [E * c, hidden]: the [E, c, hidden] stack of each expert's
  ``linear_fc2`` TP shard transposed (c columns of the row-parallel shard).

:func:`expand` turns one file's pairs into its local experts' TP shards, which the legacy
reader then numbers globally and gathers over TP like any other expert weights. Files
whose experts are spread over TP x EP instead (MindSpeed-LLM's ``--moe-tp-extend-ep``) or
replicated over TP (``--expert-tensor-parallel-size 1``) are refused by name.
"""

from __future__ import annotations

import re

import torch

_GROUPED = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)weight(?P<which>[12])$")


def is_grouped(model_state: dict) -> bool:
    return any(_GROUPED.match(name) for name in model_state)


def refuse_layouts(args, tp_size: int) -> str | None:
    """Why this checkpoint's grouped experts cannot be read (None: they can)."""
    if getattr(args, "moe_tp_extend_ep", False):
        return ("its grouped-GEMM experts were saved with moe_tp_extend_ep (experts spread "
                "over TP x EP); convert it to HF with MindSpeed-LLM's converter, or save it "
                "again without --moe-tp-extend-ep")
    if tp_size > 1 and getattr(args, "expert_tensor_parallel_size", None) == 1:
        return ("its grouped-GEMM experts were saved with expert_tensor_parallel_size=1 at "
                f"TP {tp_size}; save it again with the expert TP size equal to TP")
    return None


def expand(model_state: dict, experts_per_file: int) -> dict:
    """``model_state`` with every ``weight1``/``weight2`` pair replaced by its
    ``local_experts.<j>.linear_fc1.weight`` / ``linear_fc2.weight`` shards."""
    out = {}
    for name, tensor in model_state.items():
        match = _GROUPED.match(name)
        if match is None or not isinstance(tensor, torch.Tensor):
            out[name] = tensor
            continue
        prefix, which = match["prefix"], match["which"]
        if which == "1":
            hidden = tensor.shape[0]
            per_expert = tensor.reshape(experts_per_file, hidden, -1)
            target = "linear_fc1"
        else:
            hidden = tensor.shape[1]
            per_expert = tensor.reshape(experts_per_file, -1, hidden)
            target = "linear_fc2"
        for j in range(experts_per_file):
            out[f"{prefix}local_experts.{j}.{target}.weight"] = per_expert[j].t().contiguous()
    return out
