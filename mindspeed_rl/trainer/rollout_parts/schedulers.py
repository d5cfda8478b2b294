"""How far one rollout pass goes, and when it stops: the scheduler of a rollout.

A scheduler has one interface: ``limits(source, rows) -> PassLimits`` for the pass over
``rows`` (the continuation reads them).

- :class:`OnePass`: every row to its end (``max_tokens``, or the trajectory's end).
- :class:`TokenBudget` (partial rollout, ``partial_rollout_max_split`` N): at most
  ``ceil(limit / N)`` new model tokens per row and pass, so every row finishes within N
  passes (``limit``: max_tokens, or with tool turns ``max_total_response_length``).
- :class:`StepWise` (``rl_config.async_engine``): the engine decodes step by step
  (requests join and leave its batch on their own); with carried rows the pass stops, on
  every rank together, once the source's stop rule says enough whole groups are
  finished, and the rest stay partial rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PassLimits:
    """What one pass may do: ``tokens`` new model tokens per row at most (None: to its end);
    ``stepwise`` decoding; ``stop(finished per row) -> bool``, asked every few steps by
    every rank alike (a collective), ends the pass early (None: when this rank's rows end)."""

    tokens: int | None = None
    stepwise: bool = False
    stop: Callable[[list[bool]], bool] | None = None


class OnePass:
    @classmethod
    def build(cls, composition) -> OnePass:
        return cls()

    def limits(self, source, rows) -> PassLimits:
        return PassLimits()


class TokenBudget:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    @classmethod
    def build(cls, composition) -> TokenBudget:
        return cls(composition.pass_tokens)

    def limits(self, source, rows) -> PassLimits:
        return PassLimits(tokens=self.tokens)


class StepWise:
    @classmethod
    def build(cls, composition) -> StepWise:
        return cls()

    def limits(self, source, rows) -> PassLimits:
        return PassLimits(stepwise=True, stop=source.stop_rule(rows))
