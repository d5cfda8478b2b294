"""Core attention: the one place that picks the attention kernel of every model we build.

:func:`core_attention_class` chooses per platform (`mindspeed_rl.platform`):

* CUDA with Transformer Engine importable: megatron-core's ``TEDotProductAttention``
  (flash / cuDNN attention, THD packing, context parallelism inside TE);
* NPU with ``use_flash_attn`` (MindSpeed-RL's key): megatron-core's ``DotProductAttention``,
  whose forward MindSpeed's megatron adaptor replaces with ``npu_fusion_attention`` when its
  arguments carry ``--use-flash-attn`` (`mindspeed_rl.platform.platform` passes it);
* everywhere else, CPU included: :class:`SDPAttention`, which calls
  ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal`` so its fused
  kernels (the CPU flash kernel, CUDA flash / memory-efficient) keep memory linear in the
  sequence length: no ``[s, s]`` score matrix is ever built.

Under context parallelism (megatron's ``cp_comm_type``: ``p2p`` ring, ``a2a`` Ulysses)
:class:`SDPAttention` attends each rank's zig-zag chunks of the packed rows across the CP
group (`mindspeed_rl.models.context_parallel_attention`).

megatron-core's own local ``DotProductAttention`` materialises ``[b, heads, s, s]`` scores
plus an fp32 softmax copy, repeats K/V for grouped-query attention, refuses packed
sequences (``PackedSeqParams``) and refuses different query/key and value head sizes
(``k_channels``/``v_channels``, which multi-latent attention passes).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

# Packed rows whose lengths are within this ratio of the longest row of their group run in
# one SDPA call, padded at their end to that row (causal attention keeps the padding out of
# the real tokens, so the numbers are exact); shorter rows start a new group.
GROUP_LENGTH_RATIO = 0.75


def core_attention_class(device_type: str | None = None, use_flash_attn: bool = True):
    """The core-attention module class for the layer spec on ``device_type`` (detected when None)."""
    if device_type is None:
        from mindspeed_rl.platform import setup_platform

        device_type = setup_platform().device_type
    if device_type == "cuda" and importlib.util.find_spec("transformer_engine") is not None:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if device_type == "npu" and use_flash_attn:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention  # MindSpeed's adaptor swaps in its flash attention
    return SDPAttention


def _row_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped for batched calls: longest first, a row joins the current group
    while it is at least ``GROUP_LENGTH_RATIO`` of the group's longest row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if lengths[i] == 0:
            continue
        if groups and lengths[i] >= GROUP_LENGTH_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class SDPAttention(MegatronModule):
    """megatron-core core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for ``DotProductAttention`` in a layer spec (same constructor and forward).
    Inputs ``[s, b, heads, d]`` (or ``[t, heads, d]`` with THD ``packed_seq_params``); output
    ``[s, b, heads * d_v]`` (``[t, heads * d_v]``). Causal by the layer's mask type; an
    explicit ``attention_mask`` (megatron's: True = masked out) is honoured but costs an
    ``[s, s]`` tensor. Grouped-query attention uses SDPA's ``enable_gqa`` (K/V are not
    repeated). With ``attention_softmax_in_fp32`` and 16-bit inputs on CPU, attention runs on
    fp32 copies of q/k/v (exact fp32 softmax; on this CPU fp32 SDPA is also ~10x faster than
    bf16); on accelerators SDPA's fused kernels keep the softmax statistics in fp32.
    With a CP group of more than one rank, packed rows only: ring or Ulysses by
    ``cp_comm_type``.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        _refuse_unsupported(config)
        from megatron.core.process_groups_config import ProcessGroupCollection

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        self.cp_group, self.cp_size = _context_parallel_group(pg_collection, cp_comm_type)
        self.cp_comm_type = cp_comm_type
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = self.num_heads_per_partition * self.v_channels
        # Same scale as DotProductAttention: apply_query_key_layer_scaling divides the scores
        # by the layer number and multiplies them back inside its softmax, which cancels.
        self.softmax_scale = (1.0 / math.sqrt(self.k_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)
        self.softmax_in_fp32 = config.attention_softmax_in_fp32

    # ---- the SDPA call on [b, heads, s, d] -------------------------------------------------
    def _kernel_inputs(self, q, k, v):
        """fp32 copies for a 16-bit softmax in fp32 on CPU; one head size for q, k and v:
        fused kernels (the CPU flash kernel among them) want it, so the smaller side is
        zero-padded (zeros add nothing to q.k, padded value columns are dropped; the scale
        stays that of the real query/key head size). Heads are the last but one dim."""
        if (self.softmax_in_fp32 and q.dtype in (torch.float16, torch.bfloat16)
                and q.device.type == "cpu"):
            q, k, v = q.float(), k.float(), v.float()
        dk, dv = q.size(-1), v.size(-1)
        if dv < dk:
            v = F.pad(v, (0, dk - dv))
        elif dk < dv:
            q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
        return q, k, v

    def _sdpa(self, q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """[b, n, s, dk], [b, g, s, dk], [b, g, s, dv] -> [b, n, s, dv]."""
        out_dtype, dv = q.dtype, v.size(-1)
        q, k, v = self._kernel_inputs(q, k, v)
        causal = mask is None and self.attn_mask_type == AttnMaskType.causal
        if causal and q.size(2) != k.size(2):
            raise ValueError(f"SDPAttention: causal attention with {q.size(2)} queries and "
                             f"{k.size(2)} keys is not supported (training self-attention)")
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else ~mask, dropout_p=dropout,
            is_causal=causal, scale=self.softmax_scale,
            enable_gqa=q.size(1) != k.size(1))
        return out[..., :dv].to(out_dtype)

    def _dropout_rng(self):
        """megatron forks its TP RNG tracker for attention dropout (no SP), as DotProductAttention."""
        import contextlib

        if self.dropout_p == 0.0 or not self.training or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()

    # ---- megatron's forward ---------------------------------------------------------------
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params: Optional[PackedSeqParams] = None):
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type != self.attn_mask_type:
            raise ValueError(f"SDPAttention: built for {self.attn_mask_type}, called with "
                             f"{attn_mask_type}")
        with self._dropout_rng():
            if self.cp_size > 1:
                if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                    raise ValueError("SDPAttention: context parallelism needs packed rows "
                                     "(PackedSeqParams, THD) split in zig-zag chunks")
                return self._forward_context_parallel(query, key, value, packed_seq_params)
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._forward_thd(query, key, value, packed_seq_params)
            if packed_seq_params is not None:
                raise ValueError(f"SDPAttention: qkv_format={packed_seq_params.qkv_format!r} "
                                 "is not supported (sbhd or thd)")
            mask = attention_mask
            if mask is not None:  # [b or 1, 1, s, s]: True is masked out
                mask = mask.to(torch.bool)
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = self._sdpa(q, k, v, mask)  # [b, n, s, dv]
            return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _forward_context_parallel(self, query, key, value, params: PackedSeqParams):
        """This rank's zig-zag chunks ``[t, n, d]`` of packed rows -> ``[t, n * dv]``."""
        from mindspeed_rl.models.context_parallel_attention import (ring_attention,
                                                                   ulysses_attention)

        segments = _segments(params)
        if self.cp_comm_type == "a2a":
            out = ulysses_attention(query, key, value, segments, self.cp_group,
                                    lambda q, k, v: self._packed_rows(q, k, v, segments))
            return out.reshape(out.size(0), -1)
        dv, out_dtype = value.size(-1), query.dtype
        q, k, v = self._kernel_inputs(query, key, value)
        groups = q.size(1) // k.size(1)
        if groups > 1:  # the ring kernel takes equal head counts: repeat K/V per group
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = ring_attention(q, k, v, segments, self.softmax_scale, self.cp_group)
        return out[..., :dv].to(out_dtype).reshape(out.size(0), -1)

    def _forward_thd(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """[t, n, d] packed rows -> [t, n * dv]."""
        out = self._packed_rows(query, key, value, _segments(params))
        return out.reshape(out.size(0), -1)

    def _packed_rows(self, query, key, value, lengths: list[int]) -> torch.Tensor:
        """[t, n, d] packed rows of these lengths -> [t, n, dv]: one causal SDPA call per
        group of rows of similar length, each row padded at its end to the longest of its
        group."""
        if sum(lengths) != query.size(0):
            raise ValueError(f"SDPAttention: cu_seqlens end at {sum(lengths)} but the packed "
                             f"sequence has {query.size(0)} tokens")
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
        out = query.new_empty(query.size(0), query.size(1), value.size(-1))
        for group in _row_groups(lengths):
            longest = lengths[group[0]]
            if len(group) == 1:
                s = starts[group[0]]
                q, k, v = (t[s:s + longest].transpose(0, 1).unsqueeze(0)
                           for t in (query, key, value))  # [1, n, L, d]
                out[s:s + longest] = self._sdpa(q, k, v, None)[0].transpose(0, 1)
                continue
            start = torch.tensor([starts[i] for i in group])
            length = torch.tensor([lengths[i] for i in group])
            pos = torch.arange(longest)
            # [rows, L]: packed index of each row's token (padding repeats its last token)
            index = start[:, None] + torch.minimum(pos[None, :], length[:, None] - 1)
            index = index.to(query.device)
            q, k, v = (t[index].transpose(1, 2) for t in (query, key, value))  # [rows, n, L, d]
            o = self._sdpa(q, k, v, None).transpose(1, 2)  # [rows, L, n, dv]
            real = (pos[None, :] < length[:, None]).to(query.device)  # [rows, L]
            out[index[real]] = o[real]
        return out


def _segments(params: PackedSeqParams) -> list[int]:
    """Row lengths of the whole packed sequence (padded ones where given)."""
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
        else params.cu_seqlens_q
    cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None \
        else params.cu_seqlens_kv
    if not torch.equal(cu_q.cpu(), cu_kv.cpu()):
        raise ValueError("SDPAttention: packed rows need cu_seqlens_q == cu_seqlens_kv "
                         "(self-attention)")
    bounds = cu_q.tolist()
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _refuse_unsupported(config) -> None:
    """Attention variants this module does not compute, refused at construction."""
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"SDPAttention: softmax_type={config.softmax_type!r} is not "
                         "supported (only 'vanilla')")
    if getattr(config, "window_size", None) is not None:
        raise ValueError("SDPAttention: sliding-window attention (window_size) is not "
                         "supported")


def _context_parallel_group(pg_collection, cp_comm_type: Optional[str]):
    """(CP group or None, its size). Context parallelism
    (mindspeed_rl.models.context_parallel_attention): megatron's cp_comm_type "p2p" is ring
    attention (megatron_cp_algo), "a2a" Ulysses."""
    cp_group = getattr(pg_collection, "cp", None)
    cp_size = cp_group.size() if cp_group is not None else 1
    if cp_size > 1 and cp_comm_type not in ("p2p", "a2a"):
        raise ValueError(f"SDPAttention: cp_comm_type={cp_comm_type!r} with context "
                         "parallelism: use 'p2p' (ring) or 'a2a' (Ulysses)")
    return cp_group, cp_size
