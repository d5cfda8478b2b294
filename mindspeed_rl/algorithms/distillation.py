"""On-policy distillation: the student samples, a frozen teacher scores every sampled
token, and the student minimises the reverse KL to the teacher on its own trajectories.

The reverse KL of one response, KL(pi_s || pi_t) = E_{y ~ pi_s} sum_t [log pi_s(y_t | y_<t)
- log pi_t(y_t | y_<t)], is estimated on the sampled tokens themselves. Each token's
advantage is minus its own term (no discount, no critic, no baseline), detached, optionally
plus a coefficient times the sequence's task reward:

    A_t = -(log pi_s(y_t) - log pi_t(y_t)) + c * r      (c = 0: pure distillation)

masked by the loss mask (multi-turn tool tokens carry none). Through the clipped policy
loss, -A_t * ratio_t, its gradient at ratio 1 is sum_t (log pi_s - log pi_t) grad log pi_s:
the policy gradient of the reverse KL with the per-token reward -(log pi_s - log pi_t).

Both log-probs are at the sampling temperature (the student's are the old log-probs of the
training engine, the teacher's its own forward: ``trainer/phases.py``). The
estimator ``on_policy_distill`` runs under ``pretrain_grpo.py`` with a ``teacher_config``.
Sources: Agarwal et al. 2024 (GKD, arXiv 2306.13649) with the student's own samples and
the reverse KL; Lu & Thinking Machines Lab 2025, "On-Policy Distillation" (per-token reverse
KL as the advantage, no discount); Qwen3 technical report (arXiv 2505.09388).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.estimator import AdvantageInputs, AdvantageOutputs, Sums
from mindspeed_rl.algorithms.registry import register_estimator

TEACHER = "teacher"  # the role (built when the config has a teacher_config)
NAME = "on_policy_distill"

# Response positions (0-based token index) where the KL-by-position buckets start; the last
# bucket is open-ended. Early tokens usually diverge most (the student's opening moves).
POSITION_BUCKETS = (0, 16, 64, 256, 1024)


def reverse_kl_per_token(logprobs_student: torch.Tensor,
                         logprobs_teacher: torch.Tensor) -> torch.Tensor:
    """The single-sample estimate of KL(pi_s || pi_t) on each token sampled from the
    student: log pi_s(y_t) - log pi_t(y_t) (Schulman's k1). [batch, R] -> [batch, R]"""
    return logprobs_student.float() - logprobs_teacher.float()


def distillation_advantages(logprobs_student: torch.Tensor, logprobs_teacher: torch.Tensor,
                            mask: torch.Tensor, rewards: torch.Tensor | None = None,
                            task_reward_coef: float = 0.0) -> torch.Tensor:
    """A_t = -(log pi_s(y_t) - log pi_t(y_t)) + task_reward_coef * r on the tokens of
    ``mask``, 0 elsewhere; detached (an advantage, not a loss).

    logprobs_student, logprobs_teacher, mask: [batch, R]; rewards: [batch] sequence rewards
    (needed when task_reward_coef != 0) -> [batch, R] float32
    """
    if not (logprobs_student.shape == logprobs_teacher.shape == mask.shape):
        raise ValueError(f"student log-probs {tuple(logprobs_student.shape)}, teacher "
                         f"log-probs {tuple(logprobs_teacher.shape)} and mask "
                         f"{tuple(mask.shape)} must have one shape [batch, resp_len]")
    mask_f = mask.float()
    adv = -reverse_kl_per_token(logprobs_student, logprobs_teacher).detach()
    if task_reward_coef:
        if rewards is None:
            raise ValueError("task_reward_coef != 0 needs the sequence rewards")
        adv = adv + task_reward_coef * rewards.detach().float()[:, None]
    return adv * mask_f


def distillation_sums(logprobs_student: torch.Tensor, logprobs_teacher: torch.Tensor,
                      mask: torch.Tensor,
                      buckets: tuple[int, ...] = POSITION_BUCKETS) -> dict[str, float]:
    """The sums behind the metrics of one batch (a phase adds them over ranks, then divides:
    `distillation_metrics`): masked sums of the reverse KL, of each model's log-probs, the
    token count, and per position bucket the KL sum and token count."""
    mask_f = mask.float()
    kl = reverse_kl_per_token(logprobs_student, logprobs_teacher) * mask_f
    sums = {"kl": float(kl.sum()), "tokens": float(mask_f.sum()),
            "logp_student": float((logprobs_student.float() * mask_f).sum()),
            "logp_teacher": float((logprobs_teacher.float() * mask_f).sum()),
            "kl_seq_sum": float(kl.sum(dim=-1).sum()), "rows": float(mask.shape[0])}
    positions = torch.arange(mask.shape[-1])
    for lo, hi in zip(buckets, (*buckets[1:], None)):
        inside = (positions >= lo) & (positions < hi) if hi is not None else positions >= lo
        sums[f"kl_{_bucket(lo, hi)}"] = float(kl[:, inside].sum())
        sums[f"tokens_{_bucket(lo, hi)}"] = float(mask_f[:, inside].sum())
    return sums


def distillation_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Metrics from (globally summed) `distillation_sums`: ``distill/reverse_kl`` (per
    token), ``distill/reverse_kl_per_sequence``, ``distill/reverse_kl_pos_<lo>_<hi>`` (per
    token of that response-position bucket; buckets with no token are left out),
    ``distill/student_logprob`` and ``distill/teacher_logprob`` (per token)."""
    tokens = max(sums["tokens"], 1.0)
    out = {"distill/reverse_kl": sums["kl"] / tokens,
           "distill/reverse_kl_per_sequence": sums["kl_seq_sum"] / max(sums["rows"], 1.0),
           "distill/student_logprob": sums["logp_student"] / tokens,
           "distill/teacher_logprob": sums["logp_teacher"] / tokens}
    for key in sums:
        if key.startswith("kl_pos_") and sums["tokens_" + key[3:]] > 0:
            out[f"distill/reverse_kl_{key[3:]}"] = sums[key] / sums["tokens_" + key[3:]]
    return out


def _bucket(lo: int, hi: int | None) -> str:
    return f"pos_{lo}_{hi}" if hi is not None else f"pos_{lo}_up"


@register_estimator(
    NAME, algorithms=("grpo",), phase=p.DISTILL_ADV, reads=("logprobs_old", "logprobs_teacher"),
    params=("teacher_config.task_reward_coef",),
    needs_phases=frozenset({p.TEACHER_MODEL, p.OLD_LOG_P}),
    formula="A_t = -(log pi_student(y_t) - log pi_teacher(y_t)) + task_reward_coef * r "
            "(per-token reverse KL to teacher_config's model on the student's own samples)",
    source="Agarwal et al. 2024 (GKD, arXiv 2306.13649); Thinking Machines Lab 2025, "
           "On-Policy Distillation; Qwen3 technical report (arXiv 2505.09388)")
def on_policy_distill(x: AdvantageInputs, sums: Sums,
                      task_reward_coef: float = 0.0) -> AdvantageOutputs:
    """The per-token reverse-KL advantage on the trained tokens, and the ``distill/*``
    metrics over every rank."""
    adv = distillation_advantages(x.logprobs_old, x.logprobs_teacher, x.loss_mask,
                                  x.rewards.float() if task_reward_coef else None,
                                  task_reward_coef)
    local = distillation_sums(x.logprobs_old, x.logprobs_teacher, x.loss_mask)
    keys = sorted(local)
    return AdvantageOutputs(adv, metrics=distillation_metrics(
        dict(zip(keys, sums([local[k] for k in keys])))))
