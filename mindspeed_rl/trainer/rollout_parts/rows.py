"""Rollout rows: one sample's trajectory and where it belongs, written to the dock in one
place (its columns, and the small tags every rank reads back without moving cells).

A row is read back from the dock (:func:`rows_of`) when a source carries it into a later
pass (partial rollout); its columns depend on the run's features (:func:`row_columns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mindspeed_rl.rollout.agent_loop import Trajectory
from mindspeed_rl.trainer.columns import FINISH_REASONS

PARTIAL = FINISH_REASONS.index("partial")
ROUTED = "routed_experts"  # router_replay R3's column

# Replicated per-row tags (TransferDock.put(..., tags=...)): what the pool of carried rows
# and the rollout's metrics read on every rank.
FINISHED, BIRTH, GROUP, LENGTH = "finished", "birth", "group", "length"
PROMPT_LENGTH, MODEL_TOKENS, TURNS = "prompt_length", "model_tokens", "turns"
TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS = "tool_calls", "tool_errors", "tool_timeouts"


@dataclass
class Row:
    """One sample: its trajectory after the prompt (tokens, loss mask, behaviour log-probs,
    tool counters, the seed of its next segment) and where it belongs (prompt, group,
    sample), with the weight version of every token, its age and its segments."""

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

    def close_segment(self, tokens_before: int, version: int, iteration: int) -> None:
        """After a pass: the versions of the new tokens, the row's birth at its first."""
        self.versions += [version] * (len(self.t.tokens) - tokens_before)
        if self.num_segments == 0:  # its first token: the row's age starts
            self.birth_iteration, self.weight_version = iteration, version
        self.num_segments += 1


def fresh_rows(prompts, indices, first_group: int, n: int, version: int, seeds) -> list[Row]:
    """``n`` empty rows per prompt (all samples of a prompt together); ``seeds``: one per
    row, the seed of its first segment."""
    return [Row(Trajectory(prompt=list(prompts[k // n]), seed=int(seed)),
                prompt_index=int(indices[k // n]), group_id=first_group + k // n,
                sample_idx=k % n, weight_version=version)
            for k, seed in enumerate(seeds)]


def rows_of(batch, tags: dict[str, np.ndarray] | None = None) -> list[Row]:
    """The rows of a dock batch read with :func:`row_columns` (carried rows); ``tags``:
    their replicated tags, which restore the tool counters the columns do not hold."""
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
        if tags is not None:  # counters of earlier passes (-1: a row put without them)
            t.tool_errors = max(int(tags[TOOL_ERRORS][i]), 0)
            t.tool_timeouts = max(int(tags[TOOL_TIMEOUTS][i]), 0)
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


def row_columns(features) -> tuple[str, ...]:
    """The columns a row is written as (and a carried row read back from), by the run's
    features: the loss mask and tool calls with tool turns, the token versions, birth and
    segments when rows are carried, the engine's routes under router_replay R3."""
    names = ["prompt_ids", "response_ids", "logprobs_rollout", "prompt_index",
             "finish_reason", "weight_version", "group_id", "sample_idx"]
    if features.multi_turn:
        names += ["response_mask", "tool_calls"]
    if features.partial_rollout:
        names += ["token_versions", "birth_iteration", "num_segments"]
    if features.replays_rollout_routing:
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


def tags_of(rows: list[Row]) -> dict[str, list[int]]:
    """The rows' replicated tags: what the pool of carried rows is read from (finished,
    birth, group, length) and what the rollout's metrics are computed from."""
    t = [r.t for r in rows]
    return {FINISHED: [int(r.finished) for r in rows], BIRTH: [r.birth_iteration for r in rows],
            GROUP: [r.group_id for r in rows], LENGTH: [len(x.tokens) for x in t],
            PROMPT_LENGTH: [len(x.prompt) for x in t], MODEL_TOKENS: [x.model_tokens for x in t],
            TURNS: [x.turns for x in t], TOOL_CALLS: [x.tool_calls for x in t],
            TOOL_ERRORS: [x.tool_errors for x in t], TOOL_TIMEOUTS: [x.tool_timeouts for x in t]}


def _routing_of(row: Row) -> torch.Tensor:
    """The row's routes; ``[0, 0, 0]`` for a row no engine pass has fed yet (a carried row
    not started)."""
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
