"""Where a rollout's rows come from, and where they go after each pass.

A source has one interface, read by the rollout loop (``rollout_parts/__init__.py``):

    ready()        -> the round's rows are in (every rank agrees: replicated metadata)
    take()         -> this rank's rows of the next pass (finished ones may ride along)
    stop_rule(rows)-> the step-wise scheduler's stop rule for a pass over ``rows``, or None
    put(rows)      -> the rows after the pass, back into the dock
    close()        -> (the released row ids, every rank's; the source's own metrics)

- :class:`FreshPrompts`: the round's prompts, ``n`` new rows each; one pass, all released.
- :class:`CarriedRows` (partial rollout, ``partial_rollout_max_split`` N > 1): a pool of
  rows held in the dock across iterations. Fresh prompts enter as held rows with empty
  responses until the pool holds twice the round's groups (MindSpeed-RL's 2 x global
  batch); each pass continues every unfinished row of the pool, balanced over the
  generation-DP ranks, and puts each group back as new held rows (ids only grow; the old
  rows are retired); once the pool holds the round's finished groups (and, with
  ``require_max_age_all_finished``, no row at the age bound N - 1 is unfinished) the
  oldest finished groups are released to the phases after the rollout. Held rows carry
  over to the next iteration, in the dock and so in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspeed_rl.data import slice_per_dp_rank
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.reductions import global_sums
from mindspeed_rl.trainer.rollout_parts.rows import (BIRTH, FINISHED, GROUP, LENGTH, TOOL_ERRORS,
                                                     TOOL_TIMEOUTS, Row, columns_of, fresh_rows,
                                                     row_columns, rows_of, tags_of)


class FreshPrompts:
    """The round's prompts (:meth:`PhaseContext.take_round_prompts`), ``n`` new rows each,
    seeded by the continuation's rule for a prompt's samples; released as they are put."""

    def __init__(self, ctx: PhaseContext, sample_seeds) -> None:
        self.ctx, self.sample_seeds = ctx, sample_seeds
        self.released: list[int] = []
        self.done = False

    @classmethod
    def build(cls, ctx: PhaseContext, continuation) -> FreshPrompts:
        return cls(ctx, continuation.sample_seeds)

    def ready(self) -> bool:
        return self.done

    def take(self) -> list[Row]:
        ctx, n = self.ctx, self.ctx.rl.n_samples_per_prompt
        mine, first_group, seeds = ctx.take_round_prompts()
        row_seeds = [s for seed in seeds for s in self.sample_seeds(seed, n)]
        return fresh_rows([ctx.train_data[i].prompt_ids for i in mine], mine, first_group, n,
                          ctx.roles.actor.weight_version, row_seeds)

    def stop_rule(self, rows: list[Row]):
        return None  # nothing is carried: every row runs to its end

    def put(self, rows: list[Row]) -> None:
        ctx = self.ctx
        writer = ctx.ranks.is_gen_writer
        first = ctx.flow.next_row_id()
        ctx.flow.put_rows(columns_of(rows, row_columns(ctx.features)) if writer else {},
                          group_size=ctx.rl.n_samples_per_prompt,
                          tags=tags_of(rows) if writer else None)
        self.released = list(range(first, ctx.flow.next_row_id()))
        self.done = True

    def close(self) -> tuple[list[int], dict[str, float]]:
        return self.released, {}


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


class CarriedRows:
    """Partial rollout's pool of held rows (module docstring): passes until the round's
    ``prompts_per_generation_round`` whole finished groups can be released, oldest first."""

    def __init__(self, ctx: PhaseContext) -> None:
        self.ctx = ctx
        self.split = ctx.features.partial_rollout_max_split
        self.target = ctx.batch.prompts_per_generation_round
        self.passes = 0
        self.candidates: list[int] = []
        self._intake(2 * self.target - len(pool_of(ctx.flow).groups))
        self.pool = pool_of(ctx.flow)

    @classmethod
    def build(cls, ctx: PhaseContext, continuation) -> CarriedRows:
        return cls(ctx)

    def ready(self) -> bool:
        """The pool holds the round's finished groups and (``require_max_age_all_finished``)
        no unfinished row at the age bound; a pool of finished groups only takes in more
        prompts."""
        self.pool = pool = pool_of(self.ctx.flow)
        old = pool.ages(self.ctx.it.iteration) >= self.split - 1
        waiting = self.ctx.rl.require_max_age_all_finished and bool((old & ~pool.finished).any())
        if pool.finished.sum() >= self.target and not waiting:
            return True
        if pool.finished.all():  # nothing left to continue: more prompts
            self._intake(self.target)
            self.pool = pool_of(self.ctx.flow)
        return False

    def take(self) -> list[Row]:
        """This generation-DP rank's share of the unfinished groups (whole groups; their
        finished rows ride along unchanged), each unfinished row seeded for its segment."""
        ctx, n, pool = self.ctx, self.ctx.rl.n_samples_per_prompt, self.pool
        dp_g = ctx.plan.layout.infer_data_parallel_size
        todo = [rows for rows, done in zip(pool.groups, pool.finished) if not done]
        self.candidates = np.concatenate(todo).tolist()
        batch = ctx.flow.get(list(row_columns(ctx.features)), -(-len(todo) // dp_g) * n, "gen",
                             whole_groups=True, candidates=self.candidates)
        self.passes += 1
        if batch is None or not len(batch):
            return []
        rows = rows_of(batch, {t: ctx.flow.tags(t, batch.rows)
                               for t in (TOOL_ERRORS, TOOL_TIMEOUTS)})
        for r in rows:
            r.t.seed = self._seed(r)
        return rows

    def _seed(self, row: Row) -> int:
        """One seed per (row, segment): a resumed run continues exactly as the uninterrupted
        one, whatever the batch composition."""
        base = self.ctx.config.megatron_training.seed
        return (base * 1_000_003 + row.group_id * 10_007 + row.sample_idx * 101
                + row.num_segments * 1_000_033) % 2**31

    def stop_rule(self, rows: list[Row]):
        """The step-wise scheduler's stop rule (MindSpeed-RL's async engine): stop once the
        pool holds the round's finished groups and (``require_max_age_all_finished``) no
        row at the age bound is unfinished; agreed on by every rank (one all-reduce per
        check). ``finished`` flags the rows of ``rows`` that were unfinished."""
        ctx, split = self.ctx, self.split
        before = int(self.pool.finished.sum())
        todo = [k for k, r in enumerate(rows) if not r.finished]
        done_before = [r.finished for r in rows]
        groups = [r.group_id for r in rows]
        at_bound = [r.birth_iteration >= 0 and ctx.it.iteration - r.birth_iteration >= split - 1
                    for r in rows]

        def stop(finished: list[bool]) -> bool:
            done = list(done_before)
            for k, i in enumerate(todo):
                done[i] = finished[k]
            open_groups = {g for g, d in zip(groups, done) if not d}
            counts = [float(len(set(groups) - open_groups)),
                      float(sum(1 for d, old in zip(done, at_bound) if old and not d)),
                      float(sum(1 for d in done if not d))]
            new, old_open, active = global_sums(counts if ctx.ranks.is_gen_writer
                                                else [0.0] * 3)
            waiting = ctx.rl.require_max_age_all_finished and old_open > 0
            return active == 0 or (before + new >= self.target and not waiting)

        return stop

    def put(self, rows: list[Row]) -> None:
        """The pass's rows as new held rows; the rows they continue are retired."""
        self._put(rows)
        self.ctx.flow.retire(self.candidates)

    def _put(self, rows: list[Row]) -> None:
        ctx = self.ctx
        writer = ctx.ranks.is_gen_writer and rows
        ctx.flow.put_rows(columns_of(rows, row_columns(ctx.features)) if writer else {},
                          group_size=ctx.rl.n_samples_per_prompt, held=True,
                          tags=tags_of(rows) if writer else None)

    def _intake(self, num_groups: int) -> None:
        """``num_groups`` fresh prompts (rounded up to the generation-DP ranks) as held rows
        with empty responses; each gets a group id."""
        ctx = self.ctx
        dp_g = ctx.plan.layout.infer_data_parallel_size
        num_groups = -(-max(num_groups, 0) // dp_g) * dp_g
        if not num_groups:
            return
        n, me = ctx.rl.n_samples_per_prompt, ctx.ranks
        indices = ctx.train_data.next_indices(num_groups)
        mine = slice_per_dp_rank(indices, me.gen_dp_rank, dp_g)
        first_group = ctx.state.groups_generated + me.gen_dp_rank * len(mine)
        ctx.state.groups_generated += num_groups
        self._put(fresh_rows([ctx.train_data[i].prompt_ids for i in mine], mine, first_group, n,
                             ctx.roles.actor.weight_version, [0] * (len(mine) * n)))

    def close(self) -> tuple[list[int], dict[str, float]]:
        """Release the oldest ``target`` finished groups; drop held groups that would be too
        old to train next iteration; the pool's metrics."""
        ctx, pool, split = self.ctx, self.pool, self.split
        iteration = ctx.it.iteration
        ready = [k for k in range(len(pool.groups)) if pool.finished[k]][:self.target]
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
        return released.tolist(), {
            "partial_rollout/passes": float(self.passes),
            "partial_rollout/carried_rows": float(sum(len(pool.groups[k]) for k in carried)),
            "partial_rollout/carried_unfinished_rows":
                float(sum(int(pool.unfinished_rows[k]) for k in carried)),
            "partial_rollout/carried_tokens": float(sum(pool.lengths[k].sum() for k in carried)),
            "partial_rollout/carried_age_max": float(max((ages[k] for k in carried), default=0)),
            "partial_rollout/trained_age_mean": float(np.mean([ages[k] for k in ready]))
            if ready else 0.0,
            "partial_rollout/trained_age_max": float(max((ages[k] for k in ready), default=0)),
            "partial_rollout/dropped_groups": float(len(stale)),
        }
