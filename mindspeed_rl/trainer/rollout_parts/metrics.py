"""The rollout's metrics, one function for every composition.

What the released rows are (every rank reads their replicated tags, so no cells move):
``response_length/{mean,min,max}``, ``prompt_length/mean`` and, with tool turns,
``multi_turn/*``. What the round's passes did (summed over the ranks): the tokens they
generated and prefilled (``tokens/response``, ``tokens/prompt``, read by the throughput
metrics) and, with tool turns, the seconds they waited for tools (``timing/tools``).
docs/metrics.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspeed_rl.trainer.reductions import global_sums
from mindspeed_rl.trainer.rollout_parts.rows import (LENGTH, MODEL_TOKENS, PROMPT_LENGTH,
                                                     TOOL_CALLS, TOOL_ERRORS, TOOL_TIMEOUTS, TURNS)


@dataclass
class PassWork:
    """What this rank's passes generated (counted on the rank that writes its instance's
    rows: the TP peers generated the same tokens)."""

    response_tokens: float = 0.0   # new tokens (tool responses included)
    prompt_tokens: float = 0.0     # prompt + response so far, prefilled per row and pass
    tool_seconds: float = 0.0      # waited for tools


def rollout_metrics(flow, released: list[int], work: PassWork, *, counted: bool,
                    tools: bool, instances: int) -> dict[str, float]:
    """The metrics of a rollout that released ``released`` (global row ids); ``counted``:
    this rank speaks for its instance; ``tools``: the rows have tool turns; ``instances``:
    the vLLM instances (generation-DP size) the tool seconds are averaged over."""
    tag = {name: flow.tags(name, released).astype(np.float64)
           for name in (LENGTH, PROMPT_LENGTH, MODEL_TOKENS, TURNS, TOOL_CALLS, TOOL_ERRORS,
                        TOOL_TIMEOUTS)}
    rows = max(len(released), 1)
    lengths = tag[LENGTH]
    response, prompt, seconds = global_sums([
        work.response_tokens if counted else 0.0, work.prompt_tokens if counted else 0.0,
        work.tool_seconds if counted else 0.0])
    metrics = {"response_length/mean": float(lengths.sum()) / rows,
               "response_length/min": float(lengths.min()) if len(lengths) else 0.0,
               "response_length/max": float(lengths.max()) if len(lengths) else 0.0,
               "prompt_length/mean": float(tag[PROMPT_LENGTH].sum()) / rows,
               "tokens/response": response, "tokens/prompt": prompt}
    if not tools:
        return metrics
    calls, model = float(tag[TOOL_CALLS].sum()), float(tag[MODEL_TOKENS].sum())
    return {**metrics,
            "multi_turn/turns": float(tag[TURNS].sum()) / rows,
            "multi_turn/turns_max": float(tag[TURNS].max(initial=0.0)),
            "multi_turn/tool_calls": calls / rows,
            "multi_turn/tool_calls_max": float(tag[TOOL_CALLS].max(initial=0.0)),
            "multi_turn/tool_call_rate": float((tag[TOOL_CALLS] > 0).sum()) / rows,
            "multi_turn/model_tokens": model,
            "multi_turn/tool_tokens": float(lengths.sum()) - model,
            "multi_turn/tool_error_rate": float(tag[TOOL_ERRORS].sum()) / max(calls, 1.0),
            "multi_turn/tool_timeout_rate": float(tag[TOOL_TIMEOUTS].sum()) / max(calls, 1.0),
            # seconds the rank waited for tools, averaged over the vLLM instances
            "timing/tools": seconds / instances}
