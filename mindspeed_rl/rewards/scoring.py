"""The weighted reward of a batch of responses: every named verifier, in this process or
in the job's reward workers (``verifier_pool.py``), and the check that no score is NaN or inf."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mindspeed_rl.rewards.registry import get_verifier

if TYPE_CHECKING:
    import torch

    from mindspeed_rl.rewards.verifier_pool import RewardPool


class NonFiniteRewardError(ValueError):
    """A verifier or the reward model returned NaN or +-inf; the message names which, and
    the row."""


def check_finite_scores(scores: "torch.Tensor", source: str, fix: str,
                        responses: Sequence[str], answers: Sequence[str | None],
                        row_labels: Sequence[str] | None = None) -> None:
    """Raise :class:`NonFiniteRewardError` naming ``source``, the first row whose score is
    NaN/inf, and ``fix``: a bad number never reaches the advantages.

    scores: [N], one per response.
    """
    import torch

    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        row = row_labels[i] if row_labels is not None else f"response {i} of the batch"
        raise NonFiniteRewardError(
            f"{source} returned {scores[i].item()} for {row} (answer {answers[i]!r}, response "
            f"{responses[i][:60]!r}); rewards must be finite numbers: {fix} ({len(bad)} of "
            f"{len(scores)} rows are affected)")


def compute_rewards(responses: Sequence[str], answers: Sequence[str | None],
                    verifier_names: Sequence[str], verifier_weights: Sequence[float],
                    row_labels: Sequence[str] | None = None, pool: "RewardPool | None" = None,
                    ) -> tuple["torch.Tensor", dict[str, "torch.Tensor"]]:
    """Score each response with every named verifier and combine them.

    total_i = sum_k weight_k * verifier_k(response_i, answer_i)

    responses, answers: N decoded responses and the gold answer of each (the
    prompt's answer repeated for each of its samples).
    row_labels: where each response comes from (e.g. "train.jsonl row 7 sample 2"),
    named when a verifier returns NaN/inf (:class:`NonFiniteRewardError`): a bad
    number never reaches the advantages.
    pool: the job's :class:`~mindspeed_rl.rewards.verifier_pool.RewardPool`; each call then runs in
    a worker process within the pool's time limits (a call that times out or raises
    scores the verifier's failed score, see ``RewardPool.score``). None: in this process.
    returns: (total [N] float32, {verifier name: [N] float32 unweighted scores}).
    """
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if len(verifier_names) != len(verifier_weights):
        raise ValueError(f"{len(verifier_names)} verifiers {list(verifier_names)} but "
                         f"{len(verifier_weights)} weights {list(verifier_weights)} "
                         "(rl_config.verifier_weight needs one weight per verifier_function)")
    import torch  # here, not at import: the config checks read the registry without torch

    verifiers = [get_verifier(name) for name in verifier_names]  # fail before scoring anything
    total = torch.zeros(len(responses), dtype=torch.float32)
    per_verifier: dict[str, torch.Tensor] = {}
    in_pool = (pool.score(verifier_names, responses, answers, row_labels)[0]
               if pool is not None else None)
    for name, fn, weight in zip(verifier_names, verifiers, verifier_weights):
        scores = torch.tensor(in_pool[name] if in_pool is not None else
                              [float(fn(response, answer))
                               for response, answer in zip(responses, answers)],
                              dtype=torch.float32)  # [N]
        check_finite_scores(scores, f"verifier {name!r}", "fix the verifier", responses,
                            answers, row_labels)
        per_verifier[name] = scores
        total += float(weight) * scores
    return total, per_verifier
