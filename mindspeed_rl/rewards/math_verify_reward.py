"""The ``math_answer`` verifier: symbolic answer equivalence with math-verify.

The response is parsed with math-verify's LaTeX and plain-expression extractors
(``\\boxed{}`` first, then "the answer is ...", then the last expression, e.g.
"37 + 6 = 43" -> 43) and compared with the gold answer by ``verify`` (numeric and
symbolic equivalence: "\\frac{86}{2}" equals "43", "0.5" equals "\\frac12").

math-verify bounds its sympy work with ``signal.alarm``, which only works in the
main thread of the main interpreter; elsewhere (a reward thread pool, a Ray-like
worker thread) the timeouts are disabled instead of failing every response.
Any parse failure, timeout or exception scores 0.0.
"""

from __future__ import annotations

import functools
import logging
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from mindspeed_rl.rewards.registry import register_verifier

logger = logging.getLogger(__name__)

_TIMEOUT_S = 5
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def _timeout_s() -> int | None:
    # signal.alarm only exists for the main thread; None disables math-verify's timeout.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> tuple:
    # A bare gold ("43", "x^2+1") parses most reliably as inline LaTeX.
    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    parsed = parse(text, extraction_config=_EXTRACTION, parsing_timeout=_timeout_s())
    if not parsed:
        parsed = parse(answer, extraction_config=_EXTRACTION, parsing_timeout=_timeout_s())
    return tuple(parsed)


@register_verifier("math_answer")
def math_answer_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the gold
    ``answer``, else 0.0 (also for empty/malformed responses and a missing gold)."""
    if not isinstance(response, str) or not response.strip() or answer is None:
        return 0.0
    answer = str(answer).strip()
    if not answer:
        return 0.0
    try:
        gold = _parse_gold(answer)
        if not gold:
            return 0.0
        timeout_s = _timeout_s()
        predicted = parse(response, extraction_config=_EXTRACTION, parsing_timeout=timeout_s)
        if not predicted:
            return 0.0
        return 1.0 if verify(list(gold), predicted, timeout_seconds=timeout_s) else 0.0
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        logger.debug("math_answer: scoring failed for response %r", response[:200],
                     exc_info=True)
        return 0.0
