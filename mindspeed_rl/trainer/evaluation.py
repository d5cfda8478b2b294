"""Greedy evaluation on the test prompts, through the rollout's own continuations
(``rollout_parts/continuations.py``): one model turn, and with tool turns (multi-turn
rollouts) the agent loop as the policy trains with it.

The score is the first verifier's (a verifier that scores wrong answers below 0 counts
them as 0, so +-1 verifiers give the fraction right).
"""

from __future__ import annotations

import dataclasses

from mindspeed_rl.rewards import compute_rewards
from mindspeed_rl.trainer.reductions import global_sums
from mindspeed_rl.trainer.rollout_parts.continuations import SingleTurn, ToolTurns
from mindspeed_rl.trainer.rollout_parts.rows import Row, fresh_rows
from mindspeed_rl.trainer.rollout_parts.schedulers import PassLimits


def evaluate(config, roles, tokenizer, items, ranks, reward_pool, agent=None
             ) -> tuple[dict[str, float], list[Row]]:
    """This rank's share ``items`` of the test prompts answered greedily (the weights
    must be in the rollout engine): ``eval/accuracy``; with an ``agent`` (tool turns) the
    accuracy with the tools, ``eval/accuracy_without_tools`` and ``eval/tool_call_rate``.
    Returns the metrics (over every rank) and the one-turn rows."""
    greedy = dataclasses.replace(config.sampling_config, temperature=0.0, top_p=1.0,
                                 top_k=-1, min_p=0.0)
    plain = _answer(SingleTurn(roles.rollout, greedy), items, PassLimits())
    metrics = {"eval/accuracy": _accuracy(config, tokenizer, items, plain, ranks, reward_pool)}
    if agent is not None:  # the policy as it trains: with its tools
        tools = ToolTurns(roles.rollout, greedy, agent, tokenizer)
        rows = _answer(tools, items, PassLimits(stepwise=config.features.stepwise))
        own = ranks.is_gen_writer
        calls, count = global_sums([sum(float(r.t.tool_calls > 0) for r in rows) if own else 0.0,
                                    len(rows) if own else 0.0])
        metrics = {"eval/accuracy_without_tools": metrics["eval/accuracy"],
                   "eval/accuracy": _accuracy(config, tokenizer, items, rows, ranks, reward_pool),
                   "eval/tool_call_rate": calls / max(count, 1.0)}
    own = ranks.is_gen_writer  # TP_g peers generated the same texts
    metrics["eval/num_prompts"] = global_sums([len(items) if own else 0.0])[0]
    return metrics, plain


def _answer(continuation, items, limits: PassLimits) -> list[Row]:
    """One greedy answer per prompt (seed 0: greedy sampling draws nothing)."""
    rows = fresh_rows([p.prompt_ids for p in items], list(range(len(items))), 0, 1, 0,
                      [continuation.sample_seeds(0, 1)[0]] * len(items))
    if rows:
        continuation.advance(rows, limits)
    return rows


def _accuracy(config, tokenizer, items, rows: list[Row], ranks, reward_pool) -> float:
    rl = config.rl_config
    texts = [tokenizer.decode(r.t.tokens, skip_special_tokens=True) for r in rows]
    scores = []
    if items and rl.verifier_function:
        _, per = compute_rewards(texts, [p.answer for p in items], rl.verifier_function[:1],
                                 [1.0], pool=reward_pool)
        scores = per[rl.verifier_function[0]].clamp(min=0.0).tolist()
    own = ranks.is_gen_writer
    total, count = global_sums([sum(scores) if own else 0.0, len(scores) if own else 0.0])
    return total / max(count, 1.0)
