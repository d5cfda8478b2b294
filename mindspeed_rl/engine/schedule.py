"""Running micro-batches of rows through megatron's pipeline schedule.

Every role (actor, reference, critic, reward model) runs its rows the same way:
:func:`micro_batches_for` lays them out (fixed, token-budget or packed:
``micro_batches.py``), :func:`run_schedule` feeds the micro-batches to
``get_forward_backward_func()`` and hands each micro-batch's outputs at the
response positions to the role's loss function; :func:`forward_rows` is the
forward-only variant that returns one ``[R_i]`` tensor per row on every TP/PP
peer of the DP rank.

Micro-batches of different shapes go through one schedule call: under pipeline
parallelism megatron's ``variable_seq_lengths`` sends each activation's shape
ahead of it (three int64 per transfer).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_rl.engine.cp_micro_batch import ContextParallelOutputs, local_inputs
from mindspeed_rl.engine.efficiency import count_tokens
from mindspeed_rl.engine.micro_batches import (MicroBatch, MicroBatching, RowBatch,
                                                make_micro_batches, min_micro_batches,
                                                unit_lengths)
from mindspeed_rl.engine.packing import ROWS, packed_inputs
from mindspeed_rl.parallel.context_parallel import row_multiple
from mindspeed_rl.parallel.groups import context_parallel


class _ResponseOutputsOnly:
    """Run the output layer (vocabulary projection or value head) on response positions only.

    A forward pre-hook on the output layer replaces the hidden states [S, b, h] with the
    rows at ``response_index`` [R, b, h], so prompt positions never pay the vocabulary
    projection. Sequence parallelism keeps the hidden states split over the sequence at
    that point, so there the full outputs are computed and selected afterwards.
    """

    def __init__(self, model) -> None:
        self.index: torch.Tensor | None = None
        self.enabled = model.post_process and not model.config.sequence_parallel
        head = getattr(model, "output_layer", None) or getattr(model, "value_head", None)
        self._handle = head.register_forward_pre_hook(self._hook) if self.enabled else None

    def _hook(self, module, args):
        if self.index is None:
            return None
        hidden = args[0]  # [S, b, h]
        index = self.index.t().unsqueeze(-1).expand(-1, -1, hidden.size(-1))  # [R, b, h]
        return (hidden.gather(0, index),) + tuple(args[1:])

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def _response_hook(model) -> _ResponseOutputsOnly:
    """The model's hook, installed on first use and kept on the model itself."""
    hook = getattr(model, "_mindspeed_rl_response_outputs", None)
    if hook is None:
        hook = _ResponseOutputsOnly(model)
        model._mindspeed_rl_response_outputs = hook
    return hook


def micro_batches_for(model, batch: RowBatch, micro_batching: "int | MicroBatching",
                      rows_per_unit: int = 1) -> list[MicroBatch]:
    """This DP rank's micro-batches of ``batch`` for ``model``; with a token budget the DP
    ranks first agree on the count (the largest any of them needs), since the pipeline
    schedule and the gradient all-reduce need every rank to run the same number.
    ``rows_per_unit``: consecutive rows kept in one micro-batch (DPO's pairs)."""
    from megatron.core import parallel_state as ps

    spec = MicroBatching.of(micro_batching)
    _, cp = context_parallel()
    if cp > 1:  # CP splits packed rows (engine/cp_micro_batch.py): same numbers as padded
        spec = replace(spec, packed=True)
    if spec.packed and spec.dynamic and packed_inputs(model).backend == ROWS:
        spec = replace(spec, similar_lengths=True)  # rows side by side in attention
    count = None
    if spec.dynamic:
        t = torch.tensor([min_micro_batches(unit_lengths(batch, rows_per_unit), spec)],
                         dtype=torch.int64)
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        count = int(t.item())
    # Sequence parallelism splits each sequence over the TP ranks: S % TP must be 0.
    tp = ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
    # Context parallelism cuts every row into 2 x CP chunks (each split again over TP by SP).
    return make_micro_batches(batch, spec, count, pad_multiple=tp,
                              row_multiple=row_multiple(cp, tp) if cp > 1 else 1,
                              rows_per_unit=rows_per_unit)


def run_schedule(ddp_or_model, model, micro: list[MicroBatch], loss_fn: Callable,
                 forward_only: bool, routing=None):
    """Run micro-batches through megatron's schedule.

    ``loss_fn(outputs [b, R, ...], mb)`` receives each micro-batch's outputs at its
    response positions (vocabulary logits ``[b, R, V/tp]``, or values ``[b, R]``)
    and returns megatron's ``(loss, num_tokens, reported)``. ``routing``: a
    ``RouterReplayer`` (``engine/router_replay.py``) that records or replays each
    micro-batch's MoE routing around its forward.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hook = _response_hook(model)
    packing = packed_inputs(model)
    count_tokens(micro, training=not forward_only)
    _, cp = context_parallel()

    def forward_step(data_iterator, _model):
        mb = next(data_iterator)
        if cp > 1:  # this CP rank's chunks; the outputs of every local position
            tokens, positions, index = local_inputs(mb)
            out = _model(tokens, positions, **packing.arguments(mb))  # [1, t(, V/tp)]
            packing.done()
            return out, lambda o: loss_fn(ContextParallelOutputs(o, mb, index), mb)
        hook.index = mb.response_index
        if routing is not None:
            routing.before_forward(mb)
        out = _model(mb.tokens, mb.positions, **packing.arguments(mb))  # [b, R or S(, V/tp)]
        packing.done()
        if routing is not None:
            routing.after_forward(mb)
            routing.before_backward()
        if not hook.enabled and model.post_process:
            index = mb.response_index
            if out.dim() == 3:  # vocabulary logits; a scalar head gives [b, S]
                index = index.unsqueeze(-1).expand(-1, -1, out.size(-1))
            out = out.gather(1, index)
        return out, lambda o: loss_fn(o, mb)

    config = model.config
    variable = cp > 1 or any(m.tokens.shape != micro[0].tokens.shape for m in micro)
    saved = config.variable_seq_lengths
    config.variable_seq_lengths = saved or variable
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp_or_model],
            num_microbatches=len(micro), seq_length=micro[0].tokens.size(1),
            micro_batch_size=micro[0].tokens.size(0), forward_only=forward_only)
    finally:
        config.variable_seq_lengths = saved
        hook.index = None
        packing.done()


@torch.no_grad()
def forward_rows(model, batch: RowBatch, micro_batching: "int | MicroBatching",
                 names: tuple[str, ...],
                 per_token: Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, ...]],
                 position_shift: int = 0, routing=None) -> dict[str, list[torch.Tensor]]:
    """Forward-only: ``per_token(outputs, mb)`` gives one ``[b, R]`` tensor per name on the
    last pipeline stage; returns ``{name: [R_i] per row}`` on every rank of the DP rank
    (broadcast over the pipeline group; TP peers compute the same values).

    The outputs are read at the positions that predict each response token, or
    ``position_shift`` positions later (1: the positions of the response tokens themselves).
    """
    from megatron.core import parallel_state as ps

    model.eval()
    per_mb: list[tuple[torch.Tensor, ...]] = []

    def loss_fn(outputs, mb):
        per_mb.append(per_token(outputs, mb))
        return torch.zeros(()), {}

    micro = micro_batches_for(model, batch, micro_batching)
    for mb in micro:
        mb.response_index += position_shift * mb.mask.long()
    run_schedule(model, model, micro, loss_fn, forward_only=True, routing=routing)
    lengths = [len(r) for r in batch.responses]
    starts = [0] * len(batch)
    for i in range(1, len(batch)):
        starts[i] = starts[i - 1] + lengths[i - 1]
    # Every row's values one after the other, in batch order: [names, sum R_i].
    flat = torch.zeros(len(names), sum(lengths))
    if ps.is_pipeline_last_stage():
        for mb, values in zip(micro, per_mb):
            for row, (j, start, n) in zip(mb.rows, mb.spans):
                for k in range(len(names)):
                    flat[k, starts[row]:starts[row] + n] = values[k][j, start:start + n].float()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        dist.broadcast(flat, src=last, group=group)
    return {name: [flat[k, s:s + n].clone() for s, n in zip(starts, lengths)]
            for k, name in enumerate(names)}


def tp_reductions():
    """(all-max, all-sum, TP rank) over the tensor-parallel group (identities at TP=1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    group = ps.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return (lambda t: t), (lambda t: t), 0

    def all_max(t):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    return all_max, reduce_from_tensor_model_parallel_region, ps.get_tensor_model_parallel_rank()


def reduce_sums_once_per_dp_rank(sums: dict[str, float], keys: list[str]) -> dict[str, float]:
    """Sum per-rank statistics over the DP ranks, counting each DP rank once.

    Only the last pipeline stage computed them and TP peers hold copies, so each
    DP rank contributes through its last-stage, TP-rank-0 member.
    """
    from megatron.core import parallel_state as ps

    counts = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
              and context_parallel()[0] == 0)
    t = torch.tensor([sums.get(k, 0.0) if counts else 0.0 for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))
