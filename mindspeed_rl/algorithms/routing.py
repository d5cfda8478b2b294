"""MoE routing as a per-token column: its dtype, its filler, its comparison, its carry.

A row's routing is ``[T, L, k]``: for each of its first ``T = prompt + response - 1``
tokens (the ones a rollout engine feeds through the model; the last sampled token is
never fed), for each MoE layer ``L`` (in layer order, dense layers skipped), the ``k``
experts the router chose. Stored in the smallest integer type that holds an expert id.
Pure tensor functions; the engine (``engine/router_replay.py``) and the rollout
(``rollout/routed_experts.py``) use them.
"""

from __future__ import annotations

import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids ``0 .. num_experts - 1``."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2 ** 15:
        return torch.int16
    return torch.int32


def distinct_experts(num_tokens: int, topk: int, num_experts: int) -> torch.Tensor:
    """``[num_tokens, topk]`` int64 expert ids, distinct within each token (``arange % E``):
    what padding and a row's last token replay, so every token still occupies ``topk``
    routed slots (megatron-core's all-to-all dispatcher counts tokens x topk)."""
    if topk > num_experts:
        raise ValueError(f"top-k {topk} exceeds the {num_experts} experts")
    t = torch.arange(num_tokens).unsqueeze(1) * topk + torch.arange(topk)
    return t % num_experts


def differing_routes(used: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[L]`` int64: per MoE layer, how many tokens' expert sets differ (order ignored)
    between ``used`` and ``reference`` (both ``[T, L, k]``)."""
    if used.shape != reference.shape:
        raise ValueError(f"routing shapes differ: {tuple(used.shape)} vs "
                         f"{tuple(reference.shape)}")
    a = used.long().sort(dim=-1).values
    b = reference.long().sort(dim=-1).values
    return (a != b).any(dim=-1).sum(dim=0)


def carry_routing(earlier: torch.Tensor, later: torch.Tensor) -> torch.Tensor:
    """A continued row's routing: ``earlier`` (a previous segment's or turn's ``[T0, L, k]``)
    for the tokens it covers, then ``later``'s rows after them. ``later`` is the routing of
    the continuation, which re-read the whole row so far and generated on from it; its
    first ``T0`` rows are the re-read tokens, routed by newer weights (or a new prefill),
    and are dropped: each token keeps the routing of the pass that first fed it (a row's
    last sampled token, and tool tokens, are first fed by the continuation's prefill)."""
    if later.shape[0] < earlier.shape[0] or later.shape[1:] != earlier.shape[1:]:
        raise ValueError(f"a continuation's routing {tuple(later.shape)} does not extend the "
                         f"earlier {tuple(earlier.shape)}")
    return torch.cat([earlier, later[earlier.shape[0]:].to(earlier.dtype)])
