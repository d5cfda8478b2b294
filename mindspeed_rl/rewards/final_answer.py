"""Final-answer extraction for integer problems, and the ``integer_answer`` and
``final_answer_format`` verifiers.

Small instruct models restate the question before answering ("37 + 6 = 43"), so
scoring the *first* number scores the operand: measured on SmolLM2-135M-Instruct
for "What is 37+6?", ~0.5% accuracy (no learning signal) against ~33% when the
final answer is scored. The rule below looks for the final answer.

Final-integer rule (``extract_final_integer``), first anchor that yields a number:

1. ``\\boxed{...}`` (or ``\\fbox{...}``): the last number inside the last box.
2. an answer phrase: the word "answer" (whole word, any case: "the answer is",
   "Answer:", "final answer") -- in the text after its last occurrence, up to the
   end of that sentence or line: the first number after the last "=" if the
   sentence has one ("the answer is 37 + 6 = 43"), else the first number.
3. an "=" sign: the first number after the last "=" of the response
   ("37 + 6 = 43. I hope this helps with your 2 questions" -> 43).
4. otherwise the last number of the response ("The sum of 37 and 6 is 43.").

Numbers: an optional minus sign (not one between two operands: "37-6" is 37 and
6), digits, optional decimals; thousands separators are removed first
("1,234" -> 1234). A decimal counts as an integer only when it is integral
("43.0"); a sentence-ending period is not a decimal point ("= 43.").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

import numpy as np

from mindspeed_rl.rewards.registry import register_verifier

# A comma between a digit and exactly three digits is a thousands separator.
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# The minus sign belongs to the number only when not preceded by a word character
# or a period (so "37-6" is not 37 and -6).
_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:\.\d+)?")
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_WORD = re.compile(r"\banswer\b", re.IGNORECASE)
# A sentence ends at a newline or at . ! ? followed by a space or the end (so the
# period of "43.5" does not end it).
_SENTENCE_END = re.compile(r"\n|[.!?](?=\s|$)")


# format: a final answer in a recognisable form on the last non-empty line.
# The whitespace runs are possessive (*+): giving blanks back to the bounded
# [^\w\n]{0,8} can never help it match, and backtracking into them made
# "answer:" + 4,000 spaces take seconds (two adjacent \s* split a run n^2 ways).
_FORMAT_ANSWER = re.compile(r"\banswer\b\s*+(?:is|:)\s*+(?:[:=]\s*+)?[^\w\n]{0,8}-?\d",
                            re.IGNORECASE)
_FORMAT_EQUALS = re.compile(r"=\s*+[^\w\n=]{0,8}-?\d")


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(text)


def _last_box_content(text: str) -> str | None:
    """Content of the last-opened \\boxed{...} that closes, braces balanced; None without one.

    With depth[i] the brace depth after character i, the box whose brace is at b closes at
    the first q > b with depth[q] = depth[b] - 1, so it closes iff min(depth[b+1:]) is
    below depth[b]. numpy computes the depths and their suffix minima in a few passes: the
    scan forward from every box that this replaces is quadratic in the number of unclosed
    boxes ("\\boxed{" repeated), and a Python loop over the braces takes ~40 ms on 64 KB.
    """
    box_braces = np.array([match.end() - 1 for match in _BOX_OPEN.finditer(text)], dtype=np.int64)
    if not len(box_braces):
        return None
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # one code per character
    depth = np.cumsum((codes == ord("{")).astype(np.int64) - (codes == ord("}")))
    later_min = np.append(np.minimum.accumulate(depth[::-1])[::-1][1:],
                          np.iinfo(np.int64).max)  # later_min[i] = min(depth[i+1:])
    closing = np.flatnonzero(later_min[box_braces] < depth[box_braces])
    if not len(closing):
        return None
    b = int(box_braces[closing[-1]])
    q = b + 1 + int(np.argmax(depth[b + 1:] == depth[b] - 1))
    return text[b + 1:q]


def _after_last_equals(text: str) -> str | None:
    idx = text.rfind("=")
    return None if idx < 0 else text[idx + 1:]


def _first_number(text: str | None) -> str | None:
    if text is None:
        return None
    found = _numbers(text)
    return found[0] if found else None


def _last_number(text: str | None) -> str | None:
    if text is None:
        return None
    found = _numbers(text)
    return found[-1] if found else None


def extract_final_number(response: str) -> str | None:
    """The final-answer number of ``response`` as written (separators removed), or None.

    See the module docstring for the rule.
    """
    if not response:
        return None
    text = _THOUSANDS_SEPARATOR.sub("", response).replace("\u2212", "-")  # U+2212 minus

    box = _last_box_content(text)
    if box is not None:
        number = _last_number(box)
        if number is not None:
            return number

    answer_words = list(_ANSWER_WORD.finditer(text))
    if answer_words:
        after = text[answer_words[-1].end():]
        end = _SENTENCE_END.search(after)
        sentence = after if end is None else after[:end.start()]
        number = (_first_number(_after_last_equals(sentence)) if "=" in sentence
                  else _first_number(sentence))
        if number is not None:
            return number

    number = _first_number(_after_last_equals(text))
    if number is not None:
        return number
    return _last_number(text)


def _integral(number: str | None) -> Decimal | None:
    """``number`` as a Decimal when it is integral ("43.0"), else None."""
    if number is None:
        return None
    try:
        value = Decimal(number)
    except InvalidOperation:
        return None
    return value if value == value.to_integral_value() else None


def extract_final_integer(response: str) -> int | None:
    """``extract_final_number`` as an int; None when absent or not integral ("43.5")."""
    value = _integral(extract_final_number(response))
    return None if value is None else int(value)


def _parse_gold_integer(answer: str | None) -> Decimal | None:
    if answer is None:
        return None
    return _integral(_THOUSANDS_SEPARATOR.sub("", str(answer).strip()))


@register_verifier("integer_answer")
def integer_answer_reward(response: str, answer: str) -> float:
    """1.0 when the final integer of the response (module docstring) equals the
    integer gold answer, else 0.0 (also for an empty response or a non-integer gold)."""
    gold = _parse_gold_integer(answer)
    if gold is None or not isinstance(response, str):
        return 0.0
    # Compared as Decimals: int() of a 64 KB run of digits alone takes ~150 ms.
    return 1.0 if _integral(extract_final_number(response)) == gold else 0.0


def has_final_answer_format(response: str) -> bool:
    """Whether the last non-empty line of ``response`` states a final answer:
    a closed, non-empty ``\\boxed{...}``, "answer is N" / "answer: N" (any case, N a number,
    possibly after ``$``, ``**`` or ``\\(``), or "= N".
    """
    if not isinstance(response, str):
        return False
    lines = [line for line in response.splitlines() if line.strip()]
    if not lines:
        return False
    last = _THOUSANDS_SEPARATOR.sub("", lines[-1])
    box = _last_box_content(last)
    if box is not None and box.strip():
        return True
    return any(p.search(last) for p in (_FORMAT_ANSWER, _FORMAT_EQUALS))


# Named final_answer_format, not format: MindSpeed-RL's "format" is the <think>/<answer>
# tag check (mindspeed_rl.rewards.mindspeed_rl_verifiers).
@register_verifier("final_answer_format")
def final_answer_format_reward(response: str, answer: str) -> float:
    """1.0 when the response ends with a recognisable final answer
    (``has_final_answer_format``), else 0.0; the gold answer is not used.
    Weight it low (e.g. 0.1) next to a correctness verifier."""
    del answer  # format only
    return 1.0 if has_final_answer_format(response) else 0.0
