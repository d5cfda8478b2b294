"""Partial rollout (``rl_config.partial_rollout_max_split`` = N > 1): long responses stop
early, stay in the TransferDock and continue first in later passes, so no rollout waits
for the longest response of its batch (docs/partial_rollout.md).

The rollout phase of an iteration (or of a generation round) runs passes over a pool of
held rows until it can release ``prompts_per_generation_round`` whole, finished groups,
oldest first, to the phases after it:

    intake:   fresh prompts as held rows with empty responses, until the pool holds
              twice the round's groups (MindSpeed-RL's 2 x global batch)
    pass:     every unfinished row of the pool, balanced over the generation-DP ranks,
              continues (prompt + its tokens so far re-prefilled) for at most
              ceil(max_tokens / N) new tokens; each group comes back as new rows
              (ids only grow) and its old rows are retired
    stop:     at least the round's groups are finished, and (require_max_age_all_finished)
              every row that reached the age bound N - 1 is finished
    release:  the oldest finished groups become visible to the other phases; held rows
              carry over to the next iteration (in the dock and so in the checkpoint)

Each token keeps its behaviour log-prob (``logprobs_rollout``) and the weight version that
generated it (``token_versions``); the update weights off-policy tokens by the truncated
ratio of the recomputed (proximal) policy to their behaviour policy. Which rows every rank
sees as held, finished and how old comes from the dock's replicated tags; data moves only
through its gets and puts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mindspeed_rl.config.checks import response_limit
from mindspeed_rl.data import slice_per_dp_rank
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.multi_turn import advance, agent_of
from mindspeed_rl.trainer.reductions import global_sums
from mindspeed_rl.trainer.rollout_rows import (PARTIAL, Row, SingleTurn, columns_of, fresh_rows,
                                               row_columns, rows_of)

# Replicated per-row tags of held rows (TransferDock.put(..., tags=...)).
FINISHED, BIRTH, GROUP, LENGTH = "finished", "birth", "group", "length"
MODEL_TOKENS = "model_tokens"  # multi-turn: the row's own tokens (the loss mask's 1s)


@dataclass(frozen=True)
class Pool:
    """The held rows, by group (the same on every rank): ``groups[k]`` are the row ids of
    group k, oldest group first (by birth iteration, then group id)."""

    groups: list[np.ndarray]
    birth: np.ndarray  # per group: the iteration of its first token (-1: not started)
    finished: np.ndarray  # per group: all its rows finished
    unfinished_rows: np.ndarray  # per group: rows not finished
    lengths: list[np.ndarray]  # per group: its rows' response lengths so far

    def ages(self, iteration: int) -> np.ndarray:
        """Per group: iterations since its first token (0 if not started)."""
        return np.where(self.birth < 0, 0, iteration - self.birth)


def pool_of(flow) -> Pool:
    rows = flow.rows(held=True)
    group, birth, done, length = (flow.tags(t, rows) for t in (GROUP, BIRTH, FINISHED, LENGTH))
    ids, which = np.unique(group, return_inverse=True)
    births = np.full(len(ids), -1, dtype=np.int64)
    np.maximum.at(births, which, birth)  # a group starts in one pass: one birth per group
    open_rows = np.bincount(which, weights=(done == 0), minlength=len(ids)).astype(np.int64)
    # oldest first, groups not started last, then by group id
    order = np.lexsort((ids, np.where(births < 0, np.iinfo(np.int64).max, births)))
    members = np.argsort(which, kind="stable")
    bounds = np.cumsum(np.bincount(which, minlength=len(ids)))
    per_group = np.split(members, bounds[:-1]) if len(ids) else []
    return Pool([rows[per_group[k]] for k in order], births[order], open_rows[order] == 0,
                open_rows[order], [length[per_group[k]] for k in order])


def partial_rollout(ctx: PhaseContext) -> dict[str, float]:
    """The rollout phase with partial rollout: passes until the round's groups are ready."""
    split, target = ctx.rl.partial_rollout_max_split, ctx.batch.prompts_per_generation_round
    iteration = ctx.it.iteration
    generated = {"tokens": 0.0, "prompt_tokens": 0.0, "passes": 0}
    _intake(ctx, 2 * target - len(pool_of(ctx.flow).groups))
    while True:
        pool = pool_of(ctx.flow)
        old = pool.ages(iteration) >= split - 1
        waiting = ctx.rl.require_max_age_all_finished and bool((old & ~pool.finished).any())
        if pool.finished.sum() >= target and not waiting:
            break
        if pool.finished.all():  # nothing left to continue: more prompts
            _intake(ctx, target)
            continue
        tokens, prompt_tokens = _one_pass(ctx, pool)
        generated["tokens"] += tokens
        generated["prompt_tokens"] += prompt_tokens
        generated["passes"] += 1
    return _release(ctx, pool, target, generated)


def _intake(ctx: PhaseContext, num_groups: int) -> None:
    """``num_groups`` fresh prompts (rounded up to the generation-DP ranks) as held rows
    with empty responses; each gets a group id."""
    dp_g = ctx.plan.layout.infer_data_parallel_size
    num_groups = -(-max(num_groups, 0) // dp_g) * dp_g
    if not num_groups:
        return
    n, me = ctx.rl.n_samples_per_prompt, ctx.ranks
    indices = ctx.train_data.next_indices(num_groups)
    mine = slice_per_dp_rank(indices, me.gen_dp_rank, dp_g)
    first_group = ctx.state.groups_generated + me.gen_dp_rank * len(mine)
    ctx.state.groups_generated += num_groups
    rows = fresh_rows([ctx.train_data[i].prompt_ids for i in mine], mine, first_group, n,
                      ctx.roles.actor.weight_version, [0] * len(mine))
    _put(ctx, rows)


def _names(ctx: PhaseContext) -> tuple[str, ...]:
    """Everything a continuation reads of a row, and writes back (with the new tokens)."""
    return row_columns(partial=True, multi_turn=ctx.rl.multi_turn_enable,
                       routing=ctx.rl.router_replay == "R3")


def _put(ctx: PhaseContext, rows: list[Row]) -> None:
    """The rows (this rank's, when it writes its instance's rows) as new held rows, with the
    replicated tags every rank reads the pool from."""
    columns, tags = {}, {}
    if ctx.ranks.is_gen_writer and rows:
        columns = columns_of(rows, _names(ctx))
        tags = {FINISHED: [int(r.finished) for r in rows],
                BIRTH: [r.birth_iteration for r in rows], GROUP: [r.group_id for r in rows],
                LENGTH: [len(r.t.tokens) for r in rows]}
        if ctx.rl.multi_turn_enable:
            tags[MODEL_TOKENS] = [sum(r.t.mask) for r in rows]
    ctx.flow.put_rows(columns, group_size=ctx.rl.n_samples_per_prompt, held=True, tags=tags)


def _one_pass(ctx: PhaseContext, pool: Pool) -> tuple[float, float]:
    """Continue every unfinished row of the pool for at most ceil(max_tokens / N) tokens;
    the groups come back as new held rows and their old rows are retired. Returns the
    tokens generated and the prompt tokens prefilled (every rank's)."""

    n, me = ctx.rl.n_samples_per_prompt, ctx.ranks
    dp_g = ctx.plan.layout.infer_data_parallel_size
    todo = [rows for rows, done in zip(pool.groups, pool.finished) if not done]
    candidates = np.concatenate(todo)
    batch = ctx.flow.get(list(_names(ctx)), -(-len(todo) // dp_g) * n, "gen",
                         whole_groups=True, candidates=candidates.tolist())
    rows, new, prefill = _continue(ctx, batch, pool) if batch is not None else ([], [], [])
    _put(ctx, rows)
    ctx.flow.retire(candidates.tolist())
    generated = [float(sum(new)), float(sum(len(p) for p in prefill))]
    if not me.is_gen_writer:  # TP peers generated the same tokens
        generated = [0.0, 0.0]
    tokens, prompt_tokens = global_sums(generated)
    return tokens, prompt_tokens


def _seed(ctx: PhaseContext, group_id: int, sample: int, segment: int) -> int:
    """One seed per (row, segment): a resumed run continues exactly as the uninterrupted
    one, whatever the batch composition."""
    base = ctx.config.megatron_training.seed
    return (base * 1_000_003 + group_id * 10_007 + sample * 101 + segment * 1_000_033) % 2**31


def _continue(ctx: PhaseContext, batch, pool: Pool) -> tuple[list[Row], list[int], list]:
    """This generation-DP rank's rows after one more segment (finished rows unchanged), in
    the batch's row order; the tokens each continued row added, and what was prefilled.

    A segment is at most ceil(limit / N) new model tokens (limit: max_tokens, or with
    multi-turn max_total_response_length); with ``async_engine`` a single-turn segment runs
    to max_tokens and ends, on every rank together, once enough groups are finished. With
    multi-turn the agent loop continues each trajectory, tool turns included, until it has
    generated its segment's tokens (paused inside a model turn, or after a tool turn) or is
    done."""
    sampling, split = ctx.config.sampling_config, ctx.rl.partial_rollout_max_split
    step = math.ceil(response_limit(ctx.config) / split)
    if ctx.rl.async_engine and not ctx.rl.multi_turn_enable:
        step = sampling.max_tokens
    if not len(batch) and not ctx.rl.async_engine:
        return [], [], []
    rows = rows_of(batch) if len(batch) else []
    todo = [k for k, r in enumerate(rows) if not r.finished]
    before = [len(rows[k].t.tokens) for k in todo]
    prefill = [rows[k].t.prompt + rows[k].t.tokens for k in todo]
    seeds = [_seed(ctx, rows[k].group_id, rows[k].sample_idx, rows[k].num_segments)
             for k in todo]
    if ctx.rl.multi_turn_enable:
        _tool_turns(ctx, [rows[k] for k in todo], step, seeds)
    else:
        _single_turn(ctx, batch, pool, [rows[k] for k in todo], todo, step, seeds)
    version = ctx.roles.actor.weight_version
    for k, done in zip(todo, before):
        r = rows[k]
        r.versions += [version] * (len(r.t.tokens) - done)
        if r.num_segments == 0:  # its first token: the row's age starts
            r.birth_iteration, r.weight_version = ctx.it.iteration, version
        r.num_segments += 1
    return rows, [len(rows[k].t.tokens) - b for k, b in zip(todo, before)], prefill


def _single_turn(ctx: PhaseContext, batch, pool: Pool, rows: list[Row], todo: list[int],
                 step: int, seeds: list[int]) -> None:
    sampling = ctx.config.sampling_config
    budgets = [min(step, sampling.max_tokens - len(r.t.tokens)) for r in rows]
    least = [max(0, min(sampling.min_tokens - len(r.t.tokens), b))
             for r, b in zip(rows, budgets)]
    stop = _enough_groups(ctx, batch, todo, pool) if ctx.rl.async_engine else None
    if rows or stop is not None:
        SingleTurn(ctx.roles.rollout, sampling, show_progress=ctx.ranks.rank == 0).resume(
            rows, budgets, least, seeds, stop=stop)


def _tool_turns(ctx: PhaseContext, rows: list[Row], step: int, seeds: list[int]) -> None:
    """The agent loop over the rows for one segment of ``step`` model tokens each."""
    agent = agent_of(ctx.roles, ctx.config, ctx.tokenizer, ctx.ranks.world)
    for r, seed in zip(rows, seeds):
        r.t.seed, r.t.pass_left, r.t.paused = seed, step, False
    advance(agent, ctx.roles.rollout, ctx.tokenizer, [r.t for r in rows],
            ctx.config.sampling_config)
    for r in rows:
        r.finish = FINISH_REASONS.index(r.t.finish_reason) if r.t.done else PARTIAL


def _enough_groups(ctx: PhaseContext, batch, todo: list[int], pool: Pool):
    """The step-wise engine's stop rule (MindSpeed-RL's async engine): stop once the pool
    holds the round's finished groups and (``require_max_age_all_finished``) no row at the
    age bound is unfinished; agreed on by every rank (one all-reduce per check)."""

    target, split = ctx.batch.prompts_per_generation_round, ctx.rl.partial_rollout_max_split
    before = int(pool.finished.sum())
    groups = [int(g) for g in batch["group_id"]] if len(batch) else []
    births = [int(b) for b in batch["birth_iteration"]] if len(batch) else []
    at_bound = [b >= 0 and ctx.it.iteration - b >= split - 1 for b in births]

    def stop(finished: list[bool]) -> bool:
        done = [int(f) != PARTIAL for f in batch["finish_reason"]] if len(batch) else []
        for k, i in enumerate(todo):
            done[i] = finished[k]
        open_groups = {g for g, d in zip(groups, done) if not d}
        counts = [float(len(set(groups) - open_groups)),
                  float(sum(1 for d, old in zip(done, at_bound) if old and not d)),
                  float(sum(1 for d in done if not d))]
        new, old_open, active = global_sums(counts if ctx.ranks.is_gen_writer else [0.0] * 3)
        waiting = ctx.rl.require_max_age_all_finished and old_open > 0
        return active == 0 or (before + new >= target and not waiting)

    return stop


def _release(ctx: PhaseContext, pool: Pool, target: int, generated: dict) -> dict[str, float]:
    """Release the oldest ``target`` finished groups; drop held groups that would be too old
    to train next iteration; the round's metrics."""
    split, iteration = ctx.rl.partial_rollout_max_split, ctx.it.iteration
    ready = [k for k in range(len(pool.groups)) if pool.finished[k]][:target]
    released = np.concatenate([pool.groups[k] for k in ready]) if ready else np.zeros(0, int)
    ctx.flow.release(released.tolist())
    ctx.flow.note(f"partial_rollout/released_round{ctx.it.generation_round}",
                  sorted(released.tolist()))
    chosen = set(ready)
    rest = [k for k in range(len(pool.groups)) if k not in chosen]
    ages = pool.ages(iteration)
    stale = [k for k in rest if ages[k] >= split - 1]
    if stale:  # next iteration they would exceed the age bound N - 1
        ctx.flow.retire(np.concatenate([pool.groups[k] for k in stale]).tolist())
    carried = [k for k in rest if ages[k] < split - 1]
    carried_rows = sum(len(pool.groups[k]) for k in carried)
    lengths = [float(x) for k in ready for x in pool.lengths[k]]
    tokens = {}
    if ctx.rl.multi_turn_enable:  # the released rows' own tokens and the rest (tools, glue)
        model = float(ctx.flow.tags(MODEL_TOKENS, released.tolist()).sum()) if ready else 0.0
        tokens = {"multi_turn/model_tokens": model,
                  "multi_turn/tool_tokens": float(sum(lengths)) - model}
    return {**tokens,
        "response_length/mean": float(np.mean(lengths)) if lengths else 0.0,
        "response_length/min": min(lengths, default=0.0),
        "response_length/max": max(lengths, default=0.0),
        "partial_rollout/passes": float(generated["passes"]),
        "partial_rollout/carried_rows": float(carried_rows),
        "partial_rollout/carried_unfinished_rows":
            float(sum(int(pool.unfinished_rows[k]) for k in carried)),
        "partial_rollout/carried_tokens": float(sum(pool.lengths[k].sum() for k in carried)),
        "partial_rollout/carried_age_max": float(max((ages[k] for k in carried), default=0)),
        "partial_rollout/trained_age_mean": float(np.mean([ages[k] for k in ready]))
        if ready else 0.0,
        "partial_rollout/trained_age_max": float(max((ages[k] for k in ready), default=0)),
        "partial_rollout/dropped_groups": float(len(stale)),
        # tokens generated and prefilled (prompt + partial response) by this round's passes
        "tokens/response": generated["tokens"], "tokens/prompt": generated["prompt_tokens"],
    }
