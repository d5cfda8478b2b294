"""How a rollout row is continued: one model turn, or the agent loop with tool turns.

A continuation has one interface:

    sample_seeds(prompt_seed, n) -> the seeds of a fresh prompt's n rows
    advance(rows, limits)        -> continue each row within the pass's ``PassLimits``
                                    (``schedulers.py``); returns the seconds spent
                                    waiting for tools

- :class:`SingleTurn`: each row generates one model turn (a fresh row: its response; a
  carried row: the rest of it, prompt + tokens so far re-prefilled).
- :class:`ToolTurns` (``rl_config.multi_turn_enable``): the agent loop
  (``mindspeed_rl/rollout/agent_loop.py``) runs each row's turns, tool calls between the
  model's turns. Under a pass budget a trajectory pauses inside a model turn or after a
  tool turn and resumes there in a later pass; step-wise, each trajectory's next turn
  joins the engine's batch as soon as its own tool calls are back.

A row that stops at the pass's budget (or at the step-wise stop) before its end is
``partial`` (its ``finish``); otherwise it gets the engine's (or the loop's) finish reason.
"""

from __future__ import annotations

from mindspeed_rl.rollout.agent_loop import run_agent_loop, run_agent_loop_stepwise
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.rollout_parts.agent import agent_of
from mindspeed_rl.trainer.rollout_parts.rows import PARTIAL, Row
from mindspeed_rl.trainer.rollout_parts.schedulers import PassLimits


class SingleTurn:
    """One model turn per row on the rollout engine."""

    def __init__(self, engine, sampling, *, show_progress: bool = False) -> None:
        self.engine, self.sampling, self.show_progress = engine, sampling, show_progress

    @classmethod
    def build(cls, ctx, sampling=None) -> SingleTurn:
        return cls(ctx.roles.rollout, sampling or ctx.config.sampling_config,
                   show_progress=ctx.ranks.rank == 0)

    @staticmethod
    def sample_seeds(prompt_seed: int, n: int) -> list[int]:
        """vLLM's seeds of the n samples of one request seeded ``prompt_seed``."""
        return [prompt_seed + j for j in range(n)]

    def advance(self, rows: list[Row], limits: PassLimits) -> float:
        most = self.sampling.max_tokens
        budgets = [min(limits.tokens or most, most - len(r.t.tokens)) for r in rows]
        least = [max(0, min(self.sampling.min_tokens - len(r.t.tokens), b))
                 for r, b in zip(rows, budgets)]
        before = [len(r.t.tokens) for r in rows]
        if limits.stepwise:
            if not rows and limits.stop is None:
                return 0.0
            completions = [g[0] for g in self.engine.generate_stepwise(
                [r.t.prompt + r.t.tokens for r in rows], self.sampling,
                stop=limits.stop or all, seeds=[r.t.seed for r in rows], max_tokens=budgets,
                min_tokens=least).completions]
        else:
            completions = self._generate(rows, budgets, least) if rows else []
        for r, c, budget, start in zip(rows, completions, budgets, before):
            r.t.add_model_turn(c.token_ids, c.logprobs, c.routed_experts)
            r.t.done = not self._cut(c.finish_reason, len(c.token_ids), budget,
                                     len(r.t.tokens))
            r.finish = FINISH_REASONS.index(c.finish_reason or "stop") if r.t.done else PARTIAL
        return 0.0

    def _cut(self, reason: str | None, new: int, budget: int, length: int) -> bool:
        """Stopped by the pass (its budget, or the step-wise stop) before its end."""
        if length >= self.sampling.max_tokens:
            return False
        return reason == "abort" or (reason == "length" and new >= budget)

    def _generate(self, rows: list[Row], budgets: list[int], least: list[int]):
        """One batched call. Consecutive fresh rows of one prompt with the same limits and
        seeds s, s + 1, ... are one request of n samples (vLLM samples the j-th with seed
        s + j: the tokens of n separate requests, with one prefill)."""
        starts = [0]
        for i in range(1, len(rows)):
            head, r = rows[starts[-1]], rows[i]
            same = (not head.t.tokens and not r.t.tokens and r.t.prompt == head.t.prompt
                    and budgets[i] == budgets[starts[-1]] and least[i] == least[starts[-1]]
                    and r.t.seed == head.t.seed + i - starts[-1])
            if not same:
                starts.append(i)
        sizes = {b - a for a, b in zip(starts, starts[1:] + [len(rows)])}
        if len(sizes) != 1:  # requests of different sizes: one sample each
            starts = list(range(len(rows)))
        n = len(rows) // len(starts)
        result = self.engine.generate([rows[k].t.prompt + rows[k].t.tokens for k in starts], n,
                                      self.sampling, seeds=[rows[k].t.seed for k in starts],
                                      max_tokens=[budgets[k] for k in starts],
                                      min_tokens=[least[k] for k in starts],
                                      use_tqdm=self.show_progress)
        return [c for group in result.completions for c in group]


class ToolTurns:
    """The agent loop over the rows, tools between the model's turns."""

    def __init__(self, engine, sampling, agent, tokenizer) -> None:
        self.engine, self.sampling, self.agent, self.tokenizer = engine, sampling, agent, tokenizer

    @classmethod
    def build(cls, ctx, sampling=None) -> ToolTurns:
        agent = agent_of(ctx.roles, ctx.config, ctx.tokenizer, ctx.ranks.world)
        return cls(ctx.roles.rollout, sampling or ctx.config.sampling_config, agent,
                   ctx.tokenizer)

    @staticmethod
    def sample_seeds(prompt_seed: int, n: int) -> list[int]:
        """One trajectory seed per sample (its turns are seeded from it)."""
        return [(prompt_seed * 1_000_003 + j * 104_729) % 2**31 for j in range(n)]

    def advance(self, rows: list[Row], limits: PassLimits) -> float:
        trajectories = [r.t for r in rows]
        for t in trajectories:
            t.pass_left, t.paused = limits.tokens, False
        agent, tokenizer = self.agent, self.tokenizer
        common = dict(template=agent.template, parse=agent.parse, limits=agent.limits,
                      decode=tokenizer.decode, eos_token_id=tokenizer.eos_token_id)
        if limits.stepwise:
            stats = run_agent_loop_stepwise(self.engine, trajectories, sampling=self.sampling,
                                            pool=agent.pool, stop=limits.stop, **common)
        else:
            stats = run_agent_loop(self._generate, trajectories, pool=agent.pool,
                                   max_tokens=self.sampling.max_tokens, **common)
        for r in rows:
            r.finish = FINISH_REASONS.index(r.t.finish_reason) if r.t.done else PARTIAL
        return stats.tool_seconds

    def _generate(self, token_prompts, turn_seeds, budgets):
        result = self.engine.generate(token_prompts, 1, self.sampling, seeds=turn_seeds,
                                      max_tokens=budgets, use_tqdm=False)
        return [group[0] for group in result.completions]
