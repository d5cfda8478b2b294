"""Packed sequences (``use_remove_padding``) through megatron: what the attention backend gets.

A packed micro-batch is one sequence holding several rows; each row must attend
only to itself and see positions that restart at 0. Two ways to say that to a
megatron GPTModel:

* ``thd``: megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``, cumulative
  row lengths). The attention kernel (Transformer Engine / flash attention on
  CUDA and NPU) skips the other rows, and megatron's RoPE restarts per row.
* ``mask``: megatron's local ``DotProductAttention`` (no Transformer Engine, e.g.
  on CPU) rejects ``PackedSeqParams``; it takes an ``attention_mask``, so a
  block-diagonal causal mask keeps the rows apart, and a forward hook on the
  rotary embedding gives every position its row-relative angle. The numbers are
  those of the rows run on their own; the cost is the full ``T x T`` attention
  scores of the packed length ``T`` (bounded by ``max_packing_token_size``).

:func:`packing_backend` picks one from the model's attention module; the launcher
prints :func:`packing_notice` at start-up.
"""

from __future__ import annotations

import torch

from mindspeed_rl.trainer.micro_batches import MicroBatch

THD, MASK = "thd", "mask"


def _core_attention(model):
    """The first transformer layer's core attention module on this stage (None if none)."""
    module = getattr(model, "module", model)  # DDP wraps the GPTModel
    decoder = getattr(module, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    for layer in layers:
        attention = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if attention is not None:
            return attention
    return None


def packing_backend(model) -> str:
    """``"thd"`` when the model's attention accepts ``PackedSeqParams``, else ``"mask"``.

    megatron-core's local ``DotProductAttention`` asserts ``packed_seq_params is None``;
    Transformer Engine's attention (and MindSpeed's flash attention on NPU) take THD.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = _core_attention(model)
    if attention is None or isinstance(attention, DotProductAttention):
        return MASK
    return THD


def packing_notice(model) -> str:
    """The start-up line that says how ``use_remove_padding`` runs on this model."""
    attention = _core_attention(model)
    name = type(attention).__name__ if attention is not None else "no attention layer"
    if packing_backend(model) == THD:
        return (f"use_remove_padding: packed sequences through megatron PackedSeqParams (THD) "
                f"in {name}")
    return (f"use_remove_padding: {name} (megatron-core local attention) cannot take "
            "PackedSeqParams (THD); fallback: block-diagonal causal attention mask with "
            "per-row RoPE positions (same numbers, full T x T attention scores per packed "
            "micro-batch)")


class PackedInputs:
    """The extra forward arguments of packed micro-batches for one model.

    ``arguments(mb)`` gives the ``attention_mask`` / ``packed_seq_params`` of the next
    forward and points the rotary hook at ``mb``'s positions (mask backend); padded
    micro-batches get megatron's default causal attention (``attention_mask=None``).
    """

    def __init__(self, model) -> None:
        self.backend = packing_backend(model)
        self._positions: torch.Tensor | None = None
        rotary = getattr(getattr(model, "module", model), "rotary_pos_emb", None)
        self._handle = None
        if self.backend == MASK and rotary is not None:
            self._handle = rotary.register_forward_hook(self._rotary_hook)

    def _rotary_hook(self, module, args, emb):
        """RoPE angles at each token's own position: [S, 1, 1, d] -> [S, b, 1, d]."""
        if self._positions is None or not isinstance(emb, torch.Tensor):
            return None
        return emb[:, 0, 0, :][self._positions.t()].unsqueeze(2)

    def arguments(self, mb: MicroBatch) -> dict:
        self._positions = None
        if mb.segments is None:
            return {"attention_mask": None}
        seg = torch.tensor(mb.segments, dtype=torch.int64)
        if self.backend == THD:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = torch.zeros(len(seg) + 1, dtype=torch.int32, device=mb.tokens.device)
            cu[1:] = torch.cumsum(seg, 0)
            longest = int(seg.max())
            return {"attention_mask": None, "packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                max_seqlen_kv=longest)}
        self._positions = mb.positions
        return {"attention_mask": block_causal_mask(mb.segments).to(mb.tokens.device)}

    def done(self) -> None:
        self._positions = None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def block_causal_mask(segments: list[int]) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where a query must not see a key: another row, or later."""
    seg = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
    same_row = seg.unsqueeze(0) == seg.unsqueeze(1)
    causal = torch.ones(len(seg), len(seg), dtype=torch.bool).tril()
    return (~(same_row & causal)).view(1, 1, len(seg), len(seg))


def packed_inputs(model) -> PackedInputs:
    """The model's :class:`PackedInputs`, installed on first use and kept on the model."""
    inputs = getattr(model, "_mindspeed_rl_packed_inputs", None)
    if inputs is None:
        inputs = PackedInputs(model)
        model._mindspeed_rl_packed_inputs = inputs
    return inputs
