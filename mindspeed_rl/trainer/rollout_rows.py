"""Rollout rows: where a row comes from, how it is continued, and its dock columns, once.

A rollout is two independent choices (docs/trainer.md):

- where the rows come from: fresh prompts (:func:`fresh_rows`, every rollout) or rows
  carried in the TransferDock from an earlier pass (:func:`rows_of`, partial rollout);
- how a row is continued: one model turn (:class:`SingleTurn`) or the agent loop, tools
  between the model's turns (:class:`ToolTurns`, multi-turn). With a pass budget (partial
  rollout) either continues each row for at most that many model tokens; the agent loop
  then pauses a trajectory mid-turn, or after a tool turn, and resumes it in a later pass.

:func:`columns_of` writes the rows as the dock's columns (the column contract of
``columns.py``: which columns depends on the features the run has on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mindspeed_rl.rollout.agent_loop import Trajectory
from mindspeed_rl.trainer.columns import FINISH_REASONS

PARTIAL = FINISH_REASONS.index("partial")
ROUTED = "routed_experts"  # router_replay R3's column


@dataclass
class Row:
    """One sample: its trajectory after the prompt (tokens, loss mask, behaviour log-probs,
    tool counters) and where it belongs (prompt, group, sample), with the weight version of
    every token and, under partial rollout, its age and segments."""

    t: Trajectory
    prompt_index: int
    group_id: int
    sample_idx: int
    weight_version: int  # of its first token
    finish: int = PARTIAL  # a FINISH_REASONS code; PARTIAL until it ends
    versions: list[int] = field(default_factory=list)  # per token
    birth_iteration: int = -1  # the iteration of its first token (-1: none yet)
    num_segments: int = 0

    @property
    def finished(self) -> bool:
        return self.finish != PARTIAL


def fresh_rows(prompts, mine, first_group: int, n: int, version: int, seeds) -> list[Row]:
    """``n`` empty rows per prompt (all samples of a prompt together)."""
    trajectories = [Trajectory(prompt=list(p), seed=(s * 1_000_003 + j * 104_729) % 2**31)
                    for p, s in zip(prompts, seeds) for j in range(n)]
    return [Row(t, prompt_index=int(mine[k // n]), group_id=first_group + k // n,
                sample_idx=k % n, weight_version=version)
            for k, t in enumerate(trajectories)]


def rows_of(batch) -> list[Row]:
    """The rows of a dock batch read with :func:`row_columns` (carried rows)."""
    rows = []
    for i in range(len(batch)):
        tokens = batch["response_ids"][i].tolist()
        mask = (batch["response_mask"][i].tolist() if "response_mask" in batch.columns
                else [1] * len(tokens))
        finish = int(batch["finish_reason"][i])
        t = Trajectory(prompt=batch["prompt_ids"][i].tolist(), seed=0, tokens=tokens,
                       mask=mask, logprobs=batch["logprobs_rollout"][i].tolist(),
                       turns=_runs_of_ones(mask),
                       tool_calls=int(batch["tool_calls"][i]) if "tool_calls" in batch.columns
                       else 0, done=finish != PARTIAL,
                       routing=batch[ROUTED][i] if ROUTED in batch.columns
                       and len(batch[ROUTED][i]) else None)
        if finish == PARTIAL and mask and mask[-1] == 1:  # cut inside a model turn
            t.open_turn = len(mask) - _trailing_ones(mask)
        rows.append(Row(t, prompt_index=int(batch["prompt_index"][i]),
                        group_id=int(batch["group_id"][i]),
                        sample_idx=int(batch["sample_idx"][i]),
                        weight_version=int(batch["weight_version"][i]), finish=finish,
                        versions=batch["token_versions"][i].tolist(),
                        birth_iteration=int(batch["birth_iteration"][i]),
                        num_segments=int(batch["num_segments"][i])))
    return rows


def row_columns(*, partial: bool, multi_turn: bool, routing: bool = False) -> tuple[str, ...]:
    """The columns a row is written as (and a carried row read back from); ``routing``:
    the engine's routed experts (router_replay R3)."""
    names = ["prompt_ids", "response_ids", "logprobs_rollout", "prompt_index",
             "finish_reason", "weight_version", "group_id", "sample_idx"]
    if multi_turn:
        names += ["response_mask", "tool_calls"]
    if partial:
        names += ["token_versions", "birth_iteration", "num_segments"]
    if routing:
        names.append(ROUTED)
    return tuple(names)


def columns_of(rows: list[Row], names: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """The rows as dock columns (``names``: :func:`row_columns`)."""
    def scalar(values):
        return [torch.tensor(int(v), dtype=torch.int64) for v in values]

    every = {
        "prompt_ids": lambda: [torch.tensor(r.t.prompt) for r in rows],
        "response_ids": lambda: [torch.tensor(r.t.tokens, dtype=torch.int64) for r in rows],
        "logprobs_rollout": lambda: [torch.tensor(r.t.logprobs, dtype=torch.float32)
                                     for r in rows],
        "response_mask": lambda: [torch.tensor(r.t.mask, dtype=torch.int64) for r in rows],
        "token_versions": lambda: [torch.tensor(r.versions, dtype=torch.int64) for r in rows],
        "tool_calls": lambda: scalar(r.t.tool_calls for r in rows),
        "prompt_index": lambda: scalar(r.prompt_index for r in rows),
        "finish_reason": lambda: scalar(r.finish for r in rows),
        "weight_version": lambda: scalar(r.weight_version for r in rows),
        "birth_iteration": lambda: scalar(r.birth_iteration for r in rows),
        "num_segments": lambda: scalar(r.num_segments for r in rows),
        "group_id": lambda: scalar(r.group_id for r in rows),
        "sample_idx": lambda: scalar(r.sample_idx for r in rows),
        ROUTED: lambda: [_routing_of(r) for r in rows],
    }
    return {name: every[name]() for name in names}


def _routing_of(row: Row) -> torch.Tensor:
    """The row's routes; ``[0, 0, 0]`` for a row no engine pass has fed yet (partial
    rollout's unstarted rows)."""
    if row.t.routing is None:
        if row.t.tokens:
            raise RuntimeError(f"router_replay R3: row of group {row.group_id} has tokens but "
                               "no routing from the rollout engine (built without "
                               "record_routing?)")
        return torch.zeros((0, 0, 0), dtype=torch.uint8)
    return row.t.routing


def _runs_of_ones(mask: list[int]) -> int:
    """Model turns: the runs of the model's tokens (1s) in the loss mask."""
    return sum(1 for k, m in enumerate(mask) if m == 1 and (k == 0 or mask[k - 1] == 0))


def _trailing_ones(mask: list[int]) -> int:
    k = len(mask)
    while k and mask[k - 1] == 1:
        k -= 1
    return len(mask) - k


class SingleTurn:
    """One model turn per row: ``n`` samples of each fresh prompt in one engine call, or a
    carried row continued for at most its pass budget."""

    def __init__(self, engine, sampling, *, show_progress: bool) -> None:
        self.engine, self.sampling, self.show_progress = engine, sampling, show_progress

    def fresh(self, rows: list[Row], n: int, seeds) -> None:
        """Sample the fresh rows (``n`` per prompt, one seed per prompt)."""
        prompts = [r.t.prompt for r in rows[::n]]
        result = self.engine.generate(prompts, n, self.sampling, seeds=seeds,
                                      use_tqdm=self.show_progress)
        completions = [c for group in result.completions for c in group]
        for r, c in zip(rows, completions):
            r.t.add_model_turn(c.token_ids, c.logprobs, c.routed_experts)
            r.finish = FINISH_REASONS.index(c.finish_reason or "stop")

    def resume(self, rows: list[Row], budgets: list[int], least: list[int], seeds: list[int],
               *, stop=None) -> None:
        """Continue each row (prompt + its tokens so far) for at most its budget (at least
        ``least``). ``stop``: the step-wise engine (``async_engine``) generates until
        ``stop(finished per row)`` says enough, agreed on by every rank."""
        prompts = [r.t.prompt + r.t.tokens for r in rows]
        if stop is not None:
            result = self.engine.generate_stepwise(prompts, self.sampling, stop=stop,
                                                   seeds=seeds, max_tokens=budgets,
                                                   min_tokens=least)
        else:
            result = self.engine.generate(prompts, 1, self.sampling, seeds=seeds,
                                          max_tokens=budgets, min_tokens=least,
                                          use_tqdm=self.show_progress)
        for r, group in zip(rows, result.completions):
            c = group[0]
            r.t.add_model_turn(c.token_ids, c.logprobs, c.routed_experts)
            r.finish = _finish(c.finish_reason, len(r.t.tokens), self.sampling.max_tokens)


def _finish(reason: str | None, length: int, max_tokens: int) -> int:
    """A segment that ended at its budget is partial unless the response is at max_tokens."""
    if reason in ("length", "abort") and length < max_tokens:
        return PARTIAL
    return FINISH_REASONS.index(reason or "stop")
