"""MindSpeed-RL's rule verifiers, under their names and with their scoring rules.

A MindSpeed-RL config names these in ``rl_config.verifier_function``; each scores one
decoded response against the gold answer (the ``labels`` of their datasets):

============== ======================================================================
name           score
============== ======================================================================
math_17k_acc   1 if the last ``\\boxed{}`` content equals the answer (mathruler's
               ``grade_answer``: normalised string or sympy equality), else 0
acc_for_ppo    the same rule as math_17k_acc
base_acc       1 if the whole response has the ``<think>...</think>...<answer>...
               \\boxed{...}...</answer>`` shape and math_17k_acc holds, else 0
math_verify_   1 if the response has base_acc's shape and math-verify finds its answer
reward         equal to ``\\boxed{answer}`` (the response parsed as an expression or
               LaTeX), else 0
acc_for_dapo   1 if the last ``Answer: X`` line in the last 300 characters equals the
               answer after Minerva normalisation (Lewkowycz et al. 2022: units, TeX
               spacing and text macros removed, the part after the last ``=`` kept),
               else -1
retool_reward  1 if the last ``\\boxed{}`` in the last 100 characters equals the answer
               exactly, else -1 (MindSpeed-RL adds 0.1 per tool call to a negative
               score; there are no tool calls here)
acc            1 for a correct boxed answer, -0.5 for a wrong one, -1 when the response
               has no ``boxed``; text after the first stop word (``</s>``,
               ``<|im_end|>``, ``<|endoftext|>``) is ignored. Equality: mathruler's
               grader (MindSpeed-RL uses its own math_eval_toolkit; the two agree on
               numbers, fractions and LaTeX normal forms, not on every expression)
format         1 if the response is ``<think>...</think>`` then ``<answer>...</answer>``
               up to the end of a line, else 0
strict_format  1 if the response starts with ``<think>``, ends with ``</answer>`` and
               holds each of ``<think> </think> <answer> \\boxed{} </answer>`` exactly
               once, in that order, else -0.5
step           min(1, (number of "Step N:", "First,", "Second,", "Next,", "Finally,",
               "\\n-", "\\n*" markers, or a leading "N.") / 3)
============== ======================================================================

Like every verifier here they never raise on model output: malformed text scores as a
miss. This project's own ``format`` check of a final answer is ``final_answer_format``.
"""

from __future__ import annotations

import logging
import re

from mindspeed_rl.rewards.registry import register_verifier

logger = logging.getLogger(__name__)

# Shapes of a whole response are checked with str.find, not with the regexes that state
# them (r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>" as a fullmatch, and
# r"^<think>.*?</think>\s*<answer>.*?</answer>$" with DOTALL | MULTILINE): on model output
# those backtrack polynomially (seconds on 2 KB of repeated tags); the finds are linear.
_THINK_CLOSE_THEN_ANSWER = re.compile(r"</think>\s*+<answer>")
_ANSWER_CLOSE_ENDING_A_LINE = re.compile(r"</answer>(?=\n|\Z)")
_STEP_MARKERS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_STOP_WORDS = ("</s>", "<|im_end|>", "<|endoftext|>")
_ASSISTANT_TURN = re.compile(r"^.*?<\|im_start\|>assistant", re.DOTALL)


def _has_think_answer_boxed_shape(text: str) -> bool:
    """Whether ``text`` is ``<think>…</think>…<answer>…\\boxed{…}…</answer>`` (any text at
    the dots, newlines included), the whole text.

    Each tag is taken at its earliest place after the previous one, which leaves the most
    room for the rest, so one left-to-right pass decides it.
    """
    if not (text.startswith("<think>") and text.endswith("</answer>")):
        return False
    pos = len("<think>")
    for part in ("</think>", "<answer>", "\\boxed{", "}"):
        found = text.find(part, pos)
        if found < 0:
            return False
        pos = found + len(part)
    return pos <= len(text) - len("</answer>")


def _has_think_then_answer(text: str) -> bool:
    """Whether ``text`` starts with ``<think>``, has a ``</think>`` followed (after blanks)
    by ``<answer>``, and after that an ``</answer>`` that ends a line."""
    if not text.startswith("<think>"):
        return False
    # The earliest </think><answer> pair leaves the most room for the closing tag.
    opened = _THINK_CLOSE_THEN_ANSWER.search(text, len("<think>"))
    return opened is not None and _ANSWER_CLOSE_ENDING_A_LINE.search(text, opened.end()) is not None


def _mathruler():
    from mathruler.grader import extract_boxed_content, grade_answer

    return extract_boxed_content, grade_answer


def _boxed_equals(response: str, answer: str) -> bool:
    extract, grade = _mathruler()
    try:
        return bool(grade(extract(response), str(answer)))
    except Exception:  # noqa: BLE001 - sympy on model output: any failure is a miss
        logger.debug("grading failed for %r", response[-200:], exc_info=True)
        return False


@register_verifier("math_17k_acc")
def math_17k_acc(response: str, answer: str) -> float:
    """1.0 when the last \\boxed{} equals the answer (mathruler), else 0.0."""
    return 1.0 if isinstance(response, str) and _boxed_equals(response, answer) else 0.0


@register_verifier("acc_for_ppo")
def acc_for_ppo(response: str, answer: str) -> float:
    """MindSpeed-RL's PPO accuracy: the same rule as ``math_17k_acc``."""
    return math_17k_acc(response, answer)


@register_verifier("base_acc")
def base_acc(response: str, answer: str) -> float:
    """1.0 when the response has the think/answer/boxed shape and its box is right."""
    if not isinstance(response, str) or not _has_think_answer_boxed_shape(response):
        return 0.0
    return 1.0 if _boxed_equals(response, answer) else 0.0


@register_verifier("math_verify_reward")
def math_verify_reward(response: str, answer: str) -> float:
    """Shape as in ``base_acc``, then math-verify against ``\\boxed{answer}``."""
    if not isinstance(response, str) or not _has_think_answer_boxed_shape(response):
        return 0.0
    from math_verify.errors import TimeoutException
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    score = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        value, _ = score(["\\boxed{" + str(answer) + "}"], [response])
    except (Exception, TimeoutException):  # noqa: BLE001 - TimeoutException is a BaseException
        return 0.0
    return float(value)


# ---- acc_for_dapo: Minerva's final-answer normalisation --------------------------------------
# (text, replacement) applied in order, then the listed fragments removed.
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)


def minerva_normalise(text: str) -> str:
    """Normalise a final answer the way Minerva (and DAPO's scorer) compares them."""
    text = text.split("=")[-1]
    for before, after in _MINERVA_SUBSTITUTIONS:
        text = text.replace(before, after)
    for fragment in _MINERVA_REMOVED:
        text = text.replace(fragment, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    for macro in ("text", "textbf", "overline"):
        text = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)   # \fracab -> \frac{a}{b}
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)            # \sqrta -> \sqrt{a}
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


@register_verifier("acc_for_dapo", failed_score=-1.0)
def acc_for_dapo(response: str, answer: str) -> float:
    """1.0 when the last "Answer: X" (last 300 characters) matches after Minerva
    normalisation, else -1.0."""
    if not isinstance(response, str):
        return -1.0
    found = _ANSWER_LINE.findall(response[-300:])
    predicted = minerva_normalise(found[-1] if found else "[INVALID]")
    return 1.0 if predicted == minerva_normalise(str(answer)) else -1.0


def _last_box(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len("\\boxed{"):i]
    return None


@register_verifier("retool_reward", failed_score=-1.0)
def retool_reward(response: str, answer: str) -> float:
    """1.0 when the last box of the last 100 characters is exactly the answer, else -1.0."""
    if not isinstance(response, str):
        return -1.0
    return 1.0 if _last_box(response[-100:]) == str(answer) else -1.0


def retool_call_bonus(scores, tool_calls):
    """MindSpeed-RL's retool_reward with multi-turn on: a negative score gains 0.1 per tool
    call the trajectory made, up to 0 (calling the tool beats not trying); tensors in, out."""
    import torch

    return torch.where(scores < 0, torch.clamp(scores + 0.1 * tool_calls, max=0.0), scores)


@register_verifier("acc", failed_score=-1.0)
def acc(response: str, answer: str) -> float:
    """1.0 right, -0.5 wrong, -1.0 without a boxed answer (see the module table)."""
    if not isinstance(response, str):
        return -1.0
    text = _ASSISTANT_TURN.sub("<|im_start|>assistant", response, count=1)
    for stop in _STOP_WORDS:
        if stop in text:
            text = text.split(stop)[0].strip()
    if "boxed" not in text or not _last_box(text):
        return -1.0
    return 1.0 if _boxed_equals(text, answer) else -0.5


@register_verifier("format")
def think_answer_format(response: str, answer: str) -> float:
    """1.0 for ``<think>...</think>`` then ``<answer>...</answer>``, else 0.0."""
    del answer
    return 1.0 if isinstance(response, str) and _has_think_then_answer(response) else 0.0


def _boxes_closed_on_their_line(text: str, limit: int) -> list[int]:
    """Starts of the first ``limit`` matches of the regex ``\\\\boxed\\{.*?\\}`` (a box whose
    ``}`` is on its line), found as ``re.finditer`` would find them.

    The regex itself rescans a line from every unclosed ``\\boxed{`` on it (quadratic);
    here a box without ``}`` before the line's end skips the rest of that line, since
    every later box on it fails the same way.
    """
    starts: list[int] = []
    pos, line_end = 0, -1
    while len(starts) < limit:
        start = text.find("\\boxed{", pos)
        if start < 0:
            break
        if start > line_end:  # a new line: find its end once
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end
        close = text.find("}", start + len("\\boxed{"), line_end)
        if close < 0:
            pos = line_end + 1
            continue
        starts.append(start)
        pos = close + 1
    return starts


def _strict_structure(text: str) -> bool:
    positions = {}
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        if text.count(tag) != 1:
            return False
        positions[tag] = text.find(tag)
    boxes = _boxes_closed_on_their_line(text, limit=2)
    if len(boxes) != 1:
        return False
    box = boxes[0]
    return (positions["<think>"] < positions["</think>"] < positions["<answer>"] < box
            < positions["</answer>"] and text.startswith("<think>")
            and text.endswith("</answer>"))


@register_verifier("strict_format", failed_score=-0.5)
def strict_format(response: str, answer: str) -> float:
    """1.0 for the exact think/answer/boxed structure, else -0.5."""
    del answer
    return 1.0 if isinstance(response, str) and _strict_structure(response) else -0.5


@register_verifier("step")
def reasoning_steps(response: str, answer: str) -> float:
    """min(1, step markers / 3): rewards visibly step-by-step reasoning."""
    del answer
    if not isinstance(response, str):
        return 0.0
    return min(1.0, len(_STEP_MARKERS.findall(response)) / 3)
