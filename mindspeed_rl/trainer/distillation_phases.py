"""The phases of on-policy distillation (``rl_config.adv_estimator: on_policy_distill``,
``mindspeed_rl/algorithms/distillation.py``): the teacher's log-probs of the sampled
tokens, then the per-token reverse-KL advantage. The update is the family's own (the
clipped policy loss on the ``advantages`` column)."""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.algorithms.distillation import (distillation_advantages, distillation_metrics,
                                                  distillation_sums)
from mindspeed_rl.engine.actor import forward_logprobs
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.own_layout import logprobs_in_own_layout
from mindspeed_rl.trainer.phases import _padded, _rows
from mindspeed_rl.trainer.reductions import counts_in_train_layout, global_sums


def teacher_logprobs(ctx: PhaseContext) -> dict[str, float]:
    """The frozen teacher's log-probs of the student's sampled tokens, at the sampling
    temperature, through the same packed forward as the reference; onloaded for this phase
    only. In a layout of its own the rows of every training-DP rank are shared out over
    the teacher's DP ranks and the log-probs brought back (`trainer/own_layout.py`)."""
    batch = ctx.flow.get(["prompt_ids", "response_ids"],
                         ctx.batch.responses_per_training_dp_rank, "train")
    teacher = ctx.roles.teacher
    if teacher.layout is None:
        with teacher.swap.resident():
            logp, _ = forward_logprobs(teacher.model, _rows(batch),
                                       ctx.batch.micro_batching[names.REFERENCE_MODEL],
                                       teacher.vocab_size, temperature=ctx.temperature)
    else:
        logp = logprobs_in_own_layout(ctx, teacher.model, teacher.swap, teacher.layout,
                                      teacher.vocab_size, _rows(batch))
    ctx.flow.put(batch, {"logprobs_teacher": logp})
    return {}


def distill_advantages(ctx: PhaseContext) -> dict[str, float]:
    """A_t = -(log pi_student - log pi_teacher) (+ teacher_config.task_reward_coef x the
    sequence reward) on the model's own tokens; the reverse-KL metrics over every rank."""
    coef = ctx.config.teacher_config.task_reward_coef
    columns = ["response_ids", "logprobs_old", "logprobs_teacher"]
    if coef:
        columns.append("rewards")
    if ctx.flow.carries("response_mask"):  # multi-turn: tool tokens carry no advantage
        columns.append("response_mask")
    batch = ctx.flow.get(columns, ctx.batch.responses_per_training_dp_rank, "train")
    counted = counts_in_train_layout()
    mask, logp_student = _padded(batch["logprobs_old"])
    _, logp_teacher = _padded(batch["logprobs_teacher"])
    if "response_mask" in columns:
        mask = mask * _padded([m.float() for m in batch["response_mask"]])[1]
    rewards = torch.stack(batch["rewards"]).float() if coef else None
    adv = distillation_advantages(logp_student, logp_teacher, mask, rewards, coef)
    lengths = [len(r) for r in batch["response_ids"]]
    ctx.flow.put(batch, {"advantages": [a[:k].clone() for a, k in zip(adv, lengths)]})
    sums = distillation_sums(logp_student, logp_teacher, mask)
    keys = sorted(sums)
    totals = dict(zip(keys, global_sums([sums[k] if counted else 0.0 for k in keys])))
    return distillation_metrics(totals)
