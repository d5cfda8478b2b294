"""Packed sequences (``use_remove_padding``) through megatron: what the attention backend gets.

A packed micro-batch is one sequence holding several rows; each row must attend
only to itself and see positions that restart at 0. Two ways to say that to a
megatron GPTModel:

* ``thd``: megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``, cumulative
  row lengths). The attention kernel (Transformer Engine / flash attention on
  CUDA and NPU) skips the other rows, and megatron's RoPE restarts per row.
* ``rows``: megatron's local ``DotProductAttention`` (no Transformer Engine, e.g.
  on CPU) rejects ``PackedSeqParams``. Everything but attention is per token, so
  the packed sequence runs through the model as one; the attention module of each
  layer is called once per row, on that row's slice of the query/key/value (its
  own causal attention, as the padded path computes it), and a forward hook on
  the rotary embedding gives every position its row-relative angle. This is the
  block-diagonal causal mask without computing the masked-out blocks: a mask over
  the whole packed length ``T`` would cost ``T x T`` attention scores per layer
  (measured: the update of a ragged batch of the demo gained only 1.1x over the
  padded layout with a mask at T = 512).

:func:`packing_backend` picks one from the model's attention module; the launcher
prints :func:`packing_notice` at start-up.
"""

from __future__ import annotations

import torch

from mindspeed_rl.trainer.micro_batches import MicroBatch

THD, ROWS = "thd", "rows"


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
    """``"thd"`` when the model's attention accepts ``PackedSeqParams``, else ``"rows"``.

    megatron-core's local ``DotProductAttention`` asserts ``packed_seq_params is None``;
    Transformer Engine's attention (and MindSpeed's flash attention on NPU) take THD.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = _core_attention(model)
    if attention is None or isinstance(attention, DotProductAttention):
        return ROWS
    return THD


def packing_notice(model) -> str:
    """The start-up line that says how ``use_remove_padding`` runs on this model."""
    attention = _core_attention(model)
    name = type(attention).__name__ if attention is not None else "no attention layer"
    if packing_backend(model) == THD:
        return (f"use_remove_padding: packed sequences through megatron PackedSeqParams (THD) "
                f"in {name}")
    return (f"use_remove_padding: {name} (megatron-core local attention) cannot take "
            "PackedSeqParams (THD); fallback: packed sequences with attention run row by row "
            "(block-diagonal causal attention) and per-row RoPE positions: the same numbers")


class PackedInputs:
    """The forward arguments of packed micro-batches for one model.

    ``arguments(mb)`` gives the ``packed_seq_params`` of the next forward (THD) or
    points the per-row attention and the rotary hook at ``mb``'s rows; padded
    micro-batches get megatron's default causal attention (``attention_mask=None``).
    ``done()`` after the forward.
    """

    def __init__(self, model) -> None:
        self.backend = packing_backend(model)
        self._positions: torch.Tensor | None = None
        self._segments: list[int] | None = None
        self._handles = []
        module = getattr(model, "module", model)
        if self.backend == ROWS:
            rotary = getattr(module, "rotary_pos_emb", None)
            if rotary is not None:
                self._handles.append(rotary.register_forward_hook(self._rotary_hook))
            for layer in getattr(getattr(module, "decoder", None), "layers", None) or []:
                attention = getattr(getattr(layer, "self_attention", None), "core_attention",
                                    None)
                if attention is not None:
                    attention.forward = self._row_by_row(attention.forward)

    def _rotary_hook(self, module, args, emb):
        """RoPE angles at each token's own position: [S, 1, 1, d] -> [S, b, 1, d]."""
        if self._positions is None or not isinstance(emb, torch.Tensor):
            return None
        return emb[:, 0, 0, :][self._positions.t()].unsqueeze(2)

    def _row_by_row(self, forward):
        """The core attention of a packed sequence as one call per row ([S, b, ...] slices)."""
        def row_by_row(query, key, value, attention_mask, *args, **kwargs):
            if self._segments is None:
                return forward(query, key, value, attention_mask, *args, **kwargs)
            out, start = [], 0
            for n in self._segments:
                out.append(forward(query[start:start + n], key[start:start + n],
                                   value[start:start + n], None, *args, **kwargs))
                start += n
            return torch.cat(out, 0)
        return row_by_row

    def arguments(self, mb: MicroBatch) -> dict:
        self.done()
        if mb.segments is None:
            return {"attention_mask": None}
        if self.backend == THD:
            from megatron.core.packed_seq_params import PackedSeqParams

            seg = torch.tensor(mb.segments, dtype=torch.int64)
            cu = torch.zeros(len(seg) + 1, dtype=torch.int32, device=mb.tokens.device)
            cu[1:] = torch.cumsum(seg, 0)
            longest = int(seg.max())
            return {"attention_mask": None, "packed_seq_params": PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                max_seqlen_kv=longest)}
        self._positions, self._segments = mb.positions, mb.segments
        return {"attention_mask": None}

    def done(self) -> None:
        self._positions = self._segments = None


def packed_inputs(model) -> PackedInputs:
    """The model's :class:`PackedInputs`, installed on first use and kept on the model."""
    inputs = getattr(model, "_mindspeed_rl_packed_inputs", None)
    if inputs is None:
        inputs = PackedInputs(model)
        model._mindspeed_rl_packed_inputs = inputs
    return inputs
