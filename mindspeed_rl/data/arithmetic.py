"""A synthetic arithmetic prompt set ("What is 37+6?" -> "43") for smoke runs and
learning-signal checks on small instruct models (e.g. SmolLM2-135M-Instruct).

Problems are distinct (a, op, b) triples drawn without replacement, so train and
test never share a question. Subtraction puts the larger operand first (answers
are never negative) and operands are drawn from [1, max_operand].
"""

from __future__ import annotations

import json
import os
import random

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
QUESTION_TEMPLATE = "What is {a}{op}{b}?"
_ENUMERATE_LIMIT = 2_000_000  # below this many problems, enumerate and sample exactly


def _num_problems(max_operand: int, ops: str) -> int:
    per_op = {"+": max_operand ** 2, "*": max_operand ** 2,
              "-": max_operand * (max_operand + 1) // 2}
    return sum(per_op[op] for op in ops)


def _all_problems(max_operand: int, ops: str) -> list[tuple[int, str, int]]:
    problems = []
    for op in ops:
        for a in range(1, max_operand + 1):
            for b in range(1, (a if op == "-" else max_operand) + 1):
                problems.append((a, op, b))
    return problems


def _sample_problems(count: int, max_operand: int, ops: str,
                     rng: random.Random) -> list[tuple[int, str, int]]:
    if _num_problems(max_operand, ops) <= _ENUMERATE_LIMIT:
        return rng.sample(_all_problems(max_operand, ops), count)
    seen: set[tuple[int, str, int]] = set()
    problems = []
    while len(problems) < count:  # the space is large: rejections are rare
        op = rng.choice(ops)
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        if (a, op, b) not in seen:
            seen.add((a, op, b))
            problems.append((a, op, b))
    return problems


def make_arithmetic_problems(num_train: int, num_test: int, seed: int, max_operand: int = 100,
                             ops: str = "+-*", instruction: str | None = None,
                             ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint train and test rows ``{"prompt": "What is 37+6?", "answer": "43"}``.

    The same arguments give the same rows. ``instruction`` (e.g. "Answer with the
    number.") is appended to every question after a space.
    """
    unknown = sorted(set(ops) - set(OPERATORS))
    if not ops or unknown:
        raise ValueError(f"ops={ops!r}: use a non-empty subset of {''.join(OPERATORS)}")
    ops = "".join(dict.fromkeys(ops))  # de-duplicate, keep order
    if max_operand < 1 or num_train < 0 or num_test < 0:
        raise ValueError(f"max_operand={max_operand} must be >= 1 and the counts >= 0")
    available = _num_problems(max_operand, ops)
    if num_train + num_test > available:
        raise ValueError(f"{num_train} train + {num_test} test problems exceed the {available} "
                         f"distinct problems with operands up to {max_operand} and ops {ops!r}; "
                         "raise max_operand")
    problems = _sample_problems(num_train + num_test, max_operand, ops, random.Random(seed))
    rows = []
    for a, op, b in problems:
        question = QUESTION_TEMPLATE.format(a=a, op=op, b=b)
        if instruction:
            question = f"{question} {instruction}"
        rows.append({"prompt": question, "answer": str(OPERATORS[op](a, b))})
    return rows[:num_train], rows[num_train:]


def write_jsonl(rows: list[dict[str, str]], path: str) -> None:
    """One JSON object per line."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def with_tool_example(rows: list[dict[str, str]]) -> list[dict]:
    """Rows whose prompt is a chat: one worked example of calling the code interpreter
    (hermes ``<tool_call>``, the tool's answer, the boxed result), then the question.

    The example's question ends with the answer instruction that ``prompt_type:
    qwen_retool`` adds to the real question, so the two read alike. A 135M model does not
    call a tool it is only told about (0 of 256 samples of SmolLM2-135M-Instruct did); after
    this example it does in 29 % of its samples at temperature 0.7 (1.2 % when the example's
    question lacks the instruction), which RL can then reinforce (docs/multi_turn.md)."""
    from mindspeed_rl.data.prompts import RETOOL_ANSWER_INSTRUCTION

    call = ('<tool_call>\n{"name": "code_interpreter", "arguments": {"code": '
            '"print(123 * 456)"}}\n</tool_call>')
    example = [{"role": "user", "content": f"What is 123*456?\n{RETOOL_ANSWER_INSTRUCTION}"},
               {"role": "assistant", "content": call},
               {"role": "tool", "content": "56088"},
               {"role": "assistant", "content": "\\boxed{56088}"}]
    return [{**row, "prompt": example + [{"role": "user", "content": row["prompt"]}]}
            for row in rows]

