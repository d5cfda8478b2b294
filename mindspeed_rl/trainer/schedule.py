"""Running micro-batches of rows through megatron's pipeline schedule.

Every role (actor, reference, critic, reward model) runs its rows the same way:
:func:`run_schedule` feeds padded micro-batches to
``get_forward_backward_func()`` and hands each micro-batch's outputs at the
response positions to the role's loss function; :func:`forward_rows` is the
forward-only variant that returns one ``[R_i]`` tensor per row on every TP/PP
peer of the DP rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_rl.trainer.micro_batches import MicroBatch, RowBatch, make_micro_batches


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


def run_schedule(ddp_or_model, model, micro: list[MicroBatch], loss_fn: Callable,
                 forward_only: bool):
    """Run equal-shape micro-batches through megatron's schedule.

    ``loss_fn(outputs [b, R, ...], mb)`` receives each micro-batch's outputs at its
    response positions (vocabulary logits ``[b, R, V/tp]``, or values ``[b, R]``)
    and returns megatron's ``(loss, num_tokens, reported)``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hook = _response_hook(model)

    def forward_step(data_iterator, _model):
        mb = next(data_iterator)
        hook.index = mb.response_index
        out = _model(mb.tokens, mb.positions, attention_mask=None)  # [b, R or S(, V/tp)]
        if not hook.enabled and model.post_process:
            index = mb.response_index
            if out.dim() == 3:  # vocabulary logits; a scalar head gives [b, S]
                index = index.unsqueeze(-1).expand(-1, -1, out.size(-1))
            out = out.gather(1, index)
        return out, lambda o: loss_fn(o, mb)

    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp_or_model],
            num_microbatches=len(micro), seq_length=micro[0].tokens.size(1),
            micro_batch_size=micro[0].tokens.size(0), forward_only=forward_only)
    finally:
        hook.index = None


@torch.no_grad()
def forward_rows(model, batch: RowBatch, micro_batch_size: int, names: tuple[str, ...],
                 per_token: Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, ...]],
                 position_shift: int = 0) -> dict[str, list[torch.Tensor]]:
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
        return outputs.new_zeros(()), {}

    micro = make_micro_batches(batch, micro_batch_size)
    for mb in micro:
        mb.response_index += position_shift * mb.mask.long()
    run_schedule(model, model, micro, loss_fn, forward_only=True)
    # [names, padded rows, R]
    stacked = torch.zeros(len(names), len(micro) * micro_batch_size, micro[0].mask.size(1))
    if ps.is_pipeline_last_stage():
        for k in range(len(names)):
            stacked[k].copy_(torch.cat([m[k].float() for m in per_mb]))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        last = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        dist.broadcast(stacked, src=last, group=group)
    lengths = [len(r) for r in batch.responses]
    return {name: [stacked[k, i, :n].clone() for i, n in enumerate(lengths)]
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

    counts = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    t = torch.tensor([sums.get(k, 0.0) if counts else 0.0 for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))
