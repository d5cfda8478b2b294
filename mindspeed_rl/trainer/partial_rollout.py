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

from mindspeed_rl.data import slice_per_dp_rank
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.reductions import global_sums

# Replicated per-row tags of held rows (TransferDock.put(..., tags=...)).
FINISHED, BIRTH, GROUP, LENGTH = "finished", "birth", "group", "length"
PARTIAL = FINISH_REASONS.index("partial")
# Everything a continuation reads of a row, and writes back (with the new tokens).
ROW_COLUMNS = ("prompt_ids", "response_ids", "logprobs_rollout", "token_versions",
               "prompt_index", "finish_reason", "weight_version", "birth_iteration",
               "num_segments", "group_id", "sample_idx")


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
    columns, tags = {}, {}
    if me.is_gen_writer:
        ids = [first_group + g for g in range(len(mine)) for _ in range(n)]
        scalar = lambda values: [torch.tensor(int(v)) for v in values]  # noqa: E731
        version = ctx.roles.actor.weight_version
        columns = {
            "prompt_ids": [torch.tensor(ctx.train_data[i].prompt_ids) for i in mine
                           for _ in range(n)],
            "response_ids": [torch.zeros(0, dtype=torch.int64) for _ in ids],
            "logprobs_rollout": [torch.zeros(0, dtype=torch.float32) for _ in ids],
            "token_versions": [torch.zeros(0, dtype=torch.int64) for _ in ids],
            "prompt_index": scalar(i for i in mine for _ in range(n)),
            "finish_reason": scalar(PARTIAL for _ in ids),
            "weight_version": scalar(version for _ in ids),
            "birth_iteration": scalar(-1 for _ in ids),  # set by its first pass
            "num_segments": scalar(0 for _ in ids),
            "group_id": scalar(ids),
            "sample_idx": scalar(j for _ in mine for j in range(n)),
        }
        tags = {FINISHED: [0] * len(ids), BIRTH: [-1] * len(ids), GROUP: ids,
                LENGTH: [0] * len(ids)}
    ctx.flow.put_rows(columns, group_size=n, held=True, tags=tags)


def _one_pass(ctx: PhaseContext, pool: Pool) -> tuple[float, float]:
    """Continue every unfinished row of the pool for at most ceil(max_tokens / N) tokens;
    the groups come back as new held rows and their old rows are retired. Returns the
    tokens generated and the prompt tokens prefilled (every rank's)."""

    n, me = ctx.rl.n_samples_per_prompt, ctx.ranks
    dp_g = ctx.plan.layout.infer_data_parallel_size
    todo = [rows for rows, done in zip(pool.groups, pool.finished) if not done]
    candidates = np.concatenate(todo)
    batch = ctx.flow.get(list(ROW_COLUMNS), -(-len(todo) // dp_g) * n, "gen",
                         whole_groups=True, candidates=candidates.tolist())
    rows = _continue(ctx, batch, pool) if batch is not None else {}
    generated = [float(sum(len(r) for r in rows.get("new", []))),
                 float(sum(len(p) for p in rows.get("prefill", [])))]
    columns, tags = {}, {}
    if me.is_gen_writer and rows:
        columns = {name: rows[name] for name in ROW_COLUMNS}
        tags = {FINISHED: [int(int(f) != PARTIAL) for f in rows["finish_reason"]],
                BIRTH: [int(b) for b in rows["birth_iteration"]],
                GROUP: [int(g) for g in rows["group_id"]],
                LENGTH: [len(r) for r in rows["response_ids"]]}
    ctx.flow.put_rows(columns, group_size=n, held=True, tags=tags)
    ctx.flow.retire(candidates.tolist())
    if not me.is_gen_writer:  # TP peers generated the same tokens
        generated = [0.0, 0.0]
    tokens, prompt_tokens = global_sums(generated)
    return tokens, prompt_tokens


def _seed(ctx: PhaseContext, group_id: int, sample: int, segment: int) -> int:
    """One seed per (row, segment): a resumed run continues exactly as the uninterrupted
    one, whatever the batch composition."""
    base = ctx.config.megatron_training.seed
    return (base * 1_000_003 + group_id * 10_007 + sample * 101 + segment * 1_000_033) % 2**31


def _continue(ctx: PhaseContext, batch, pool: Pool) -> dict[str, list]:
    """This generation-DP rank's rows after one more segment (finished rows unchanged), in
    the batch's row order, plus ``new`` (the tokens generated) and ``prefill``.

    A segment is at most ceil(max_tokens / N) tokens; with ``async_engine`` it runs to
    max_tokens and ends, on every rank together, once enough groups are finished."""
    sampling, split = ctx.config.sampling_config, ctx.rl.partial_rollout_max_split
    step = sampling.max_tokens if ctx.rl.async_engine else math.ceil(sampling.max_tokens / split)
    if not len(batch) and not ctx.rl.async_engine:
        return {}
    out = {name: list(batch[name]) for name in ROW_COLUMNS}
    todo = [i for i, f in enumerate(batch["finish_reason"]) if int(f) == PARTIAL]
    prompts, budgets, least, seeds = [], [], [], []
    for i in todo:
        done = len(batch["response_ids"][i])
        prompts.append(torch.cat([batch["prompt_ids"][i], batch["response_ids"][i]]).tolist())
        budgets.append(min(step, sampling.max_tokens - done))
        least.append(max(0, min(sampling.min_tokens - done, budgets[-1])))
        seeds.append(_seed(ctx, int(batch["group_id"][i]), int(batch["sample_idx"][i]),
                           int(batch["num_segments"][i])))
    if ctx.rl.async_engine:
        result = ctx.roles.rollout.generate_stepwise(
            prompts, sampling, stop=_enough_groups(ctx, batch, todo, pool), seeds=seeds,
            max_tokens=budgets, min_tokens=least)
    else:
        result = ctx.roles.rollout.generate(prompts, 1, sampling, seeds=seeds,
                                            max_tokens=budgets, min_tokens=least,
                                            use_tqdm=ctx.ranks.rank == 0) if todo else None
    version = ctx.roles.actor.weight_version
    new = []
    for k, i in enumerate(todo):
        c = result.completions[k][0]
        new.append(c.token_ids)
        ids = torch.cat([out["response_ids"][i], torch.tensor(c.token_ids, dtype=torch.int64)])
        out["response_ids"][i] = ids
        out["logprobs_rollout"][i] = torch.cat(
            [out["logprobs_rollout"][i], torch.tensor(c.logprobs, dtype=torch.float32)])
        out["token_versions"][i] = torch.cat(
            [out["token_versions"][i], torch.full((len(c.token_ids),), version)])
        if int(out["num_segments"][i]) == 0:  # its first token: the row's age starts
            out["birth_iteration"][i] = torch.tensor(ctx.it.iteration)
            out["weight_version"][i] = torch.tensor(version)
        out["num_segments"][i] = out["num_segments"][i] + 1
        out["finish_reason"][i] = torch.tensor(_finish(c.finish_reason, len(ids),
                                                       sampling.max_tokens))
    out["new"], out["prefill"] = new, prompts
    return out


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


def _finish(reason: str | None, length: int, max_tokens: int) -> int:
    """A segment that ended at its budget is partial unless the response is at max_tokens."""
    if reason in ("length", "abort") and length < max_tokens:
        return PARTIAL
    return FINISH_REASONS.index(reason or "stop")


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
    return {
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
