"""The actor (and the frozen reference) as megatron-core models in the training sharding.

`build_policy_model` builds this rank's GPTModel shard and fills it from a
megatron checkpoint or an HF directory; `MegatronActor` adds DDP, the megatron
optimizer and LR schedule. `forward_logprobs` and `MegatronActor.update` run
padded micro-batches of (prompt, response) rows through megatron's pipeline
schedule; only response positions go through the vocabulary projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import (entropy_from_vocab_parallel_logits, kl_penalty,
                                     logprobs_from_vocab_parallel_logits, masked_sum, policy_loss)
from mindspeed_rl.fault.nonfinite import StepGuard  # [issue 13]

# Padded vocabulary columns get this logit: exp() underflows to exactly 0 and, unlike
# -inf, 0 * logit stays 0 in the entropy.
_MASKED_LOGIT = -1e9


# ---------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------
def build_policy_model(arch, *, params_dtype: torch.dtype, sequence_parallel: bool,
                       calculate_per_token_loss: bool = True):
    """This rank's GPTModel shard of ``arch`` (weights random until loaded)."""
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config

    config = build_transformer_config(arch, params_dtype=params_dtype,
                                      sequence_parallel=sequence_parallel,
                                      calculate_per_token_loss=calculate_per_token_loss)
    return build_gpt_model(arch, config)


@dataclass(frozen=True)
class OptimizerSettings:
    """``actor_config`` optimizer keys plus the number of optimizer steps of the run."""

    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    clip_grad: float
    lr_decay_style: str
    lr_warmup_fraction: float
    total_steps: int
    use_distributed_optimizer: bool
    bf16: bool
    max_consecutive_skipped_steps: int = 3  # [issue 13] rl_config.max_consecutive_skipped_steps


class MegatronActor:
    """The trainable policy: GPTModel in DDP, megatron optimizer and LR schedule."""

    def __init__(self, model, settings: OptimizerSettings) -> None:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.model = model
        config = model.config
        self.ddp = DistributedDataParallel(
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=settings.use_distributed_optimizer))
        # Without these two hooks DP and sequence-parallel grads are silently not reduced.
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.ddp.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
                            weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
                            adam_beta2=settings.adam_beta2, clip_grad=settings.clip_grad,
                            bf16=settings.bf16, params_dtype=config.params_dtype,
                            use_distributed_optimizer=settings.use_distributed_optimizer),
            [self.ddp])
        warmup = int(settings.lr_warmup_fraction * settings.total_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else settings.lr, max_lr=settings.lr,
            min_lr=settings.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=max(settings.total_steps, 1), lr_decay_style=settings.lr_decay_style,
            start_wd=settings.weight_decay, end_wd=settings.weight_decay,
            wd_incr_steps=max(settings.total_steps, 1), wd_incr_style="constant")
        self.step_guard = StepGuard(settings.max_consecutive_skipped_steps)  # [issue 13]

    @property
    def chunks(self) -> list:
        return [self.ddp]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def update(self, batch: "RowBatch", micro_batch_size: int, *, clip_ratio: float,
               kl_coef: float, kl_kind: str, entropy_coeff: float,
               vocab_size: int) -> dict[str, float]:
        """One optimizer step on ``batch`` (this DP rank's share of a mini-batch).

        The loss is a token mean over the whole mini-batch (all DP ranks):
        megatron sums per-token losses over micro-batches and divides the grads by
        the global token count (``calculate_per_token_loss``).
        """
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.model.train()
        sums: dict[str, float] = {}

        def loss_fn(logits, mb: "MicroBatch"):
            logp = _response_logprobs(logits, mb, vocab_size)
            mask = mb.mask
            # On-policy (one mini-batch, one epoch): the policy that would compute the old
            # log-probs is this one, so they are exactly logp without gradient.
            logp_old = mb.extras["logprobs_old"] if "logprobs_old" in mb.extras else logp.detach()
            pg_sum, stats = policy_loss(logp, logp_old, mb.extras["advantages"],
                                        mask, clip_ratio, clip_ratio, "token-mean",
                                        num_tokens_global=1.0)  # = sum over this micro-batch
            loss = pg_sum
            kl_sum = torch.zeros(())
            if kl_coef:
                kl_sum = masked_sum(kl_penalty(logp, mb.extras["logprobs_ref"], kl_kind), mask)
                loss = loss + kl_coef * kl_sum
            with torch.set_grad_enabled(entropy_coeff != 0 and torch.is_grad_enabled()):
                ent_sum = masked_sum(_response_entropy(logits, vocab_size), mask)
            if entropy_coeff:
                loss = loss - entropy_coeff * ent_sum
            n = mask.sum()
            for key, value in (("pg_loss", pg_sum), ("kl_loss", kl_sum), ("entropy", ent_sum),
                               ("pg_clipfrac", stats["pg_clipfrac"] * n),
                               ("ppo_kl", stats["approx_kl"] * n), ("tokens", n)):
                sums[key] = sums.get(key, 0.0) + float(value.detach())  # [issue 13] no warning
            return loss, n.to(torch.int), {"loss": loss.detach().clone()}

        _run_schedule(self.ddp, self.model, make_micro_batches(batch, micro_batch_size),
                      loss_fn, forward_only=False)
        # [issue 13] NaN/Inf in the loss or a gradient: every rank skips this step (weights
        # and LR schedule unchanged); too many in a row raise NonFiniteError.
        if self.step_guard.should_skip(sums.values(), self.ddp):
            ok, grad_norm = False, float("nan")
        else:
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        stats = _reduce_token_sums(sums)
        stats["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        stats["update_ok"] = float(bool(ok))
        return stats


# ---------------------------------------------------------------------------------------
# batches of rows
# ---------------------------------------------------------------------------------------
@dataclass
class RowBatch:
    """Rows of (prompt ids, response ids) plus per-row extra tensors (one DP rank's share)."""

    prompts: list[torch.Tensor]  # each [P_i] int64
    responses: list[torch.Tensor]  # each [R_i] int64
    extras: dict[str, list[torch.Tensor]]  # e.g. logprobs_old: each [R_i]; advantages: [1]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, S] prompt+response, right-padded
    positions: torch.Tensor  # [b, S]
    response_index: torch.Tensor  # [b, R] position whose logits predict response token t
    response_ids: torch.Tensor  # [b, R]
    mask: torch.Tensor  # [b, R] float, 1 on real response tokens
    extras: dict[str, torch.Tensor]  # [b, R] (per token) or [b, 1] broadcast to [b, R]
    num_real_rows: int


def make_micro_batches(batch: RowBatch, micro_batch_size: int, pad_id: int = 0) -> list[MicroBatch]:
    """Pad rows into equal-shape micro-batches (the pipeline schedule needs one shape).

    Every micro-batch has ``micro_batch_size`` rows (missing rows are empty, mask 0)
    and the same sequence length S = max(P_i + R_i) over the batch.
    """
    seq_len = max((len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)), default=1)
    resp_len = max((len(r) for r in batch.responses), default=1)
    out = []
    for start in range(0, max(len(batch), 1), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(batch))))
        b = micro_batch_size
        tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
        response_ids = torch.full((b, resp_len), pad_id, dtype=torch.long)
        response_index = torch.zeros((b, resp_len), dtype=torch.long)
        mask = torch.zeros((b, resp_len))
        extras = {k: torch.zeros((b, resp_len)) for k in batch.extras}
        for row, i in enumerate(idx):
            p, r = batch.prompts[i], batch.responses[i]
            tokens[row, :len(p)] = p
            tokens[row, len(p):len(p) + len(r)] = r
            response_ids[row, :len(r)] = r
            # logits at position t predict token t+1
            response_index[row, :len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
            mask[row, :len(r)] = 1.0
            for k, values in batch.extras.items():
                v = values[i].float()
                extras[k][row, :len(r)] = v if v.numel() == len(r) else v.expand(len(r))
        positions = torch.arange(seq_len).unsqueeze(0).expand(b, -1)
        out.append(MicroBatch(tokens, positions, response_index, response_ids, mask, extras, len(idx)))
    return out


# ---------------------------------------------------------------------------------------
# running micro-batches through megatron
# ---------------------------------------------------------------------------------------
class _ResponseLogitsOnly:
    """Project only response positions onto the vocabulary.

    A forward pre-hook on the output layer replaces the hidden states [S, b, h] with the
    rows at ``response_index`` [R, b, h], so prompt positions never pay the vocabulary
    projection. Sequence parallelism keeps the hidden states split over the sequence at
    that point, so there the full logits are computed and selected afterwards.
    """

    def __init__(self, model) -> None:
        self.index: torch.Tensor | None = None
        self.enabled = model.post_process and not model.config.sequence_parallel
        self._handle = (model.output_layer.register_forward_pre_hook(self._hook)
                        if self.enabled else None)

    def _hook(self, module, args):
        if self.index is None:
            return None
        hidden = args[0]  # [S, b, h]
        index = self.index.t().unsqueeze(-1).expand(-1, -1, hidden.size(-1))  # [R, b, h]
        return (hidden.gather(0, index),) + tuple(args[1:])

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


def _response_hook(model) -> _ResponseLogitsOnly:
    """The model's hook, installed on first use and kept on the model itself."""
    hook = getattr(model, "_mindspeed_rl_response_logits", None)
    if hook is None:
        hook = _ResponseLogitsOnly(model)
        model._mindspeed_rl_response_logits = hook
    return hook


def _run_schedule(ddp_or_model, model, micro: list[MicroBatch],
                  loss_fn: Callable, forward_only: bool):
    """Run equal-shape micro-batches through megatron's schedule.

    ``loss_fn(logits [b, R, V/tp], mb)`` receives each micro-batch's response logits."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hook = _response_hook(model)

    def forward_step(data_iterator, _model):
        mb = next(data_iterator)
        hook.index = mb.response_index
        logits = _model(mb.tokens, mb.positions, attention_mask=None)  # [b, R or S, V/tp]
        if not hook.enabled and model.post_process:
            index = mb.response_index.unsqueeze(-1).expand(-1, -1, logits.size(-1))
            logits = logits.gather(1, index)
        return logits, lambda out: loss_fn(out, mb)

    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp_or_model],
            num_microbatches=len(micro), seq_length=micro[0].tokens.size(1),
            micro_batch_size=micro[0].tokens.size(0), forward_only=forward_only)
    finally:
        hook.index = None


def _tp_reductions():
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


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Megatron pads the vocabulary (multiple of 128); vLLM and HF never sample pads."""
    _, _, tp_rank = _tp_reductions()
    shard = logits.size(-1)
    start = tp_rank * shard
    if start + shard <= vocab_size:
        return logits.float()
    cols = torch.arange(start, start + shard)
    return logits.float().masked_fill(cols >= vocab_size, _MASKED_LOGIT)


def _response_logprobs(logits: torch.Tensor, mb: MicroBatch, vocab_size: int) -> torch.Tensor:
    all_max, all_sum, tp_rank = _tp_reductions()
    logits = _mask_padded_vocab(logits, vocab_size)
    return logprobs_from_vocab_parallel_logits(logits, mb.response_ids, tp_rank * logits.size(-1),
                                               all_max, all_sum)  # [b, R]


def _response_entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    all_max, all_sum, _ = _tp_reductions()
    return entropy_from_vocab_parallel_logits(_mask_padded_vocab(logits, vocab_size), all_max,
                                              all_sum)  # [b, R]


@torch.no_grad()
def forward_logprobs(model, batch: RowBatch, micro_batch_size: int, vocab_size: int,
                     with_entropy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-row response log-probs (and entropies) on every rank of the model's DP group.

    The last pipeline stage computes them; they are broadcast over the pipeline group
    so every TP/PP peer of this DP rank holds the same result. Returns ([R_i], [R_i]).
    """
    from megatron.core import parallel_state as ps

    model.eval()
    per_mb: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss_fn(logits, mb):
        logp = _response_logprobs(logits, mb, vocab_size)
        ent = _response_entropy(logits, vocab_size) if with_entropy else torch.zeros_like(logp)
        per_mb.append((logp, ent))
        return logp.new_zeros(()), {}

    micro = make_micro_batches(batch, micro_batch_size)
    _run_schedule(model, model, micro, loss_fn, forward_only=True)
    resp_len = micro[0].mask.size(1)
    logp_all = torch.zeros(len(micro) * micro_batch_size, resp_len)
    ent_all = torch.zeros_like(logp_all)
    if ps.is_pipeline_last_stage():
        logp_all.copy_(torch.cat([lp for lp, _ in per_mb]))
        ent_all.copy_(torch.cat([e for _, e in per_mb]))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        group = ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
        dist.broadcast(logp_all, src=src, group=group)
        dist.broadcast(ent_all, src=src, group=group)
    lengths = [len(r) for r in batch.responses]
    return ([logp_all[i, :n].clone() for i, n in enumerate(lengths)],
            [ent_all[i, :n].clone() for i, n in enumerate(lengths)])


def _reduce_token_sums(sums: dict[str, float]) -> dict[str, float]:
    """Token-weighted means over the whole mini-batch from per-rank sums.

    Only the last pipeline stage computed losses, and TP peers hold copies: count each
    DP rank once (its last-stage, TP-rank-0 member).
    """
    from megatron.core import parallel_state as ps

    counts = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    keys = ["pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "tokens"]
    t = torch.tensor([sums.get(k, 0.0) if counts else 0.0 for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    tokens = max(t[-1].item(), 1.0)
    return {k: (t[i] / tokens).item() for i, k in enumerate(keys[:-1])} | {"tokens": t[-1].item()}

