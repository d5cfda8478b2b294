"""Packed sequences (``use_remove_padding``) through megatron: what the attention backend gets.

A packed micro-batch is one sequence holding several rows; each row must attend
only to itself and see positions that restart at 0. Two ways to say that to a
megatron GPTModel:

* ``thd``: megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``, cumulative
  row lengths). The core attention (`mindspeed_rl.models.attention`: SDPA per row
  group on CPU, Transformer Engine on CUDA) attends within each row, and megatron's
  RoPE restarts per row. This is what our models use.
* ``rows``: megatron's local ``DotProductAttention`` (the class MindSpeed patches
  with its flash attention on NPU) rejects ``PackedSeqParams``. Everything but attention is per token, so
  the packed sequence runs through the model as one ``[T, 1, h]`` sequence; only
  inside each layer's core attention are its rows laid side by side
  (``[longest row, rows, ...]``, gathered from the packed query/key/value), run
  with megatron's own causal attention, and scattered back. A row's padding
  comes after its real tokens, so causal attention keeps it out of them: the
  numbers are those of the padded layout, while the projections, the MLP and the
  output layer see no padding at all. A forward hook on the rotary embedding
  gives every position its row-relative angle. This is the block-diagonal causal
  mask without computing the masked-out blocks: a mask over the whole packed
  length ``T`` costs ``T x T`` attention scores per layer (measured on the demo's
  ragged update, against the padded layout: 1.1x with such a mask at T = 512,
  1.5-1.7x with one core-attention call per row, 1.72x side by side;
  ``docs/micro_batches.md``).

:func:`packing_backend` picks one from the model's attention module; the launcher
prints :func:`packing_notice` at start-up.
"""

from __future__ import annotations

import torch

from mindspeed_rl.engine.micro_batches import MicroBatch

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
            "PackedSeqParams (THD); fallback: packed sequences whose rows are laid side by "
            "side inside attention only (causal per row) with per-row RoPE positions: the "
            "same numbers")


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
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # gather, scatter
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
                    attention.forward = self._rows_side_by_side(attention.forward)

    def _rotary_hook(self, module, args, emb):
        """RoPE angles at each token's own position: [S, 1, 1, d] -> [S, b, 1, d]."""
        if self._positions is None or not isinstance(emb, torch.Tensor):
            return None
        return emb[:, 0, 0, :][self._positions.t()].unsqueeze(2)

    def _rows_side_by_side(self, forward):
        """Core attention of a packed ``[T, 1, ...]`` sequence with its rows as a batch."""
        def side_by_side(query, key, value, attention_mask, *args, **kwargs):
            if self._rows is None:
                return forward(query, key, value, attention_mask, *args, **kwargs)
            gather, scatter = self._rows  # [longest, rows] into T; [T] into longest x rows
            q, k, v = (t[:, 0][gather] for t in (query, key, value))  # [longest, rows, n, d]
            out = forward(q, k, v, None, *args, **kwargs)  # [longest, rows, n*d]
            return out.reshape(-1, out.size(-1))[scatter].unsqueeze(1)  # [T, 1, n*d]
        return side_by_side

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
        self._positions, self._rows = mb.positions, _side_by_side(mb.segments)
        return {"attention_mask": None}

    def done(self) -> None:
        self._positions = self._rows = None


def _side_by_side(segments: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index maps between a packed sequence of rows of these lengths and the rows side
    by side: ``gather [longest, rows]`` (packed position of row r's token t; a row's
    padding repeats its last token) and ``scatter [T]`` (where each packed position lands
    in the flattened ``[longest, rows]``)."""
    lengths = torch.tensor(segments)
    starts = torch.cumsum(lengths, 0) - lengths
    t = torch.arange(int(lengths.max())).unsqueeze(1)  # [longest, 1]
    gather = starts + torch.minimum(t, lengths - 1)  # [longest, rows]
    row = torch.repeat_interleave(torch.arange(len(segments)), lengths)
    scatter = (torch.arange(int(lengths.sum())) - starts[row]) * len(segments) + row
    return gather, scatter


def packed_inputs(model) -> PackedInputs:
    """The model's :class:`PackedInputs`, installed on first use and kept on the model."""
    inputs = getattr(model, "_mindspeed_rl_packed_inputs", None)
    if inputs is None:
        inputs = PackedInputs(model)
        model._mindspeed_rl_packed_inputs = inputs
    return inputs
