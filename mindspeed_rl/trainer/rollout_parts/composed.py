"""One composed rollout: the loop over a source, a continuation and a scheduler, and the
tables that build the parts ``config.features.rollout`` names (``rollout_parts/``'s
docstring shows the loop)."""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.config import features as f
from mindspeed_rl.engine.efficiency import count_generation
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.rollout_parts.continuations import SingleTurn, ToolTurns
from mindspeed_rl.trainer.rollout_parts.metrics import PassWork, rollout_metrics
from mindspeed_rl.trainer.rollout_parts.schedulers import OnePass, StepWise, TokenBudget
from mindspeed_rl.trainer.rollout_parts.sources import CarriedRows, FreshPrompts

SOURCES = {f.FRESH: FreshPrompts, f.CARRIED: CarriedRows}
CONTINUATIONS = {f.SINGLE_TURN: SingleTurn, f.TOOL_TURNS: ToolTurns}
SCHEDULERS = {f.ONE_PASS: OnePass, f.TOKEN_BUDGET: TokenBudget, f.STEPWISE: StepWise}


@dataclass
class Rollout:
    """One composed rollout (:func:`compose`)."""

    ctx: PhaseContext
    source: object
    continuation: object
    scheduler: object

    def run(self) -> dict[str, float]:
        """Passes until the source's round is ready; the released rows' metrics."""
        ctx, work = self.ctx, PassWork()
        version, iteration = ctx.roles.actor.weight_version, ctx.it.iteration
        while not self.source.ready():
            rows = self.source.take()
            todo = [r for r in rows if not r.finished]
            before = [len(r.t.tokens) for r in todo]
            work.tool_seconds += self.continuation.advance(
                todo, self.scheduler.limits(self.source, rows))
            for r, start in zip(todo, before):
                r.close_segment(start, version, iteration)
            # per row: its context (prompt + response so far) and the tokens this pass added
            grown = [(r, len(r.t.prompt) + b, len(r.t.tokens) - b) for r, b in zip(todo, before)]
            work.response_tokens += sum(new for _, _, new in grown)
            work.prompt_tokens += sum(context for _, context, _ in grown)
            if ctx.ranks.is_gen_writer:  # its TP peers generated the same tokens
                count_generation(((tuple(r.t.prompt) + tuple(r.t.tokens[:b]), context, new)
                                  for (r, context, new), b in zip(grown, before)))
            self.source.put(rows)
        released, own = self.source.close()
        return {**rollout_metrics(ctx.flow, released, work, counted=ctx.ranks.is_gen_writer,
                                  tools=ctx.features.multi_turn,
                                  instances=ctx.plan.layout.infer_data_parallel_size), **own}


def compose(ctx: PhaseContext) -> Rollout:
    """The job's rollout: one part of each kind, as ``config.features.rollout`` names them."""
    parts = ctx.features.rollout
    continuation = CONTINUATIONS[parts.continuation].build(ctx)
    return Rollout(ctx, SOURCES[parts.source].build(ctx, continuation), continuation,
                   SCHEDULERS[parts.scheduler].build(parts))
