"""docs/reliability.md matches the code: every message in its tables is one the code can
produce.

Each table's message column is checked against the string constants of the code (the
package, tools/, the launchers; f-strings contribute their literal parts): every word of
a documented message must be covered by some constant, except values (placeholders such
as ``<dir>`` and ``…``, quoted strings, lists, numbers, dotted or underscored names) and
the words that only exist at run time (exception class names, operating-system error
texts, signal names). A message reworded in the code, or written in the doc from memory,
leaves uncovered words and fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"

# Words that the code does not spell: the run time does (type names, strerror, signals),
# a value the code fills in (a dock operation, a number, a choice, an architecture), or a
# test's own verifier in the documented example.
RUNTIME_WORDS = {"OSError", "No", "space", "left", "device", "Operation", "not", "permitted",
                 "NonFiniteError", "ValueError", "SIGKILL", "False", "True", "this", "response",
                 "GPT2LMHeadModel", "put", "nan", "str", "constant", "linear", "cosine",
                 "llama"}
# Values inside a message: placeholders, quoted text, lists, numbers, names with _ . / or
# digits (keys, paths, file names).
_VALUE = re.compile(r"<[^<>]*>|…|\.\.\.|'[^']*'|\[[^\]]*\]|-?\d+(?:\.\d+)?|[\w./-]*[_./\d][\w./-]*")


_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_MAX_RUN = 12


def _words(text: str) -> list[list[str]]:
    """The runs of words of ``text`` between its values, run-time words and ``:;()``."""
    runs = []
    for segment in re.split(r"[:;()]", _VALUE.sub(":", text)):
        run = []
        for word in _WORD.findall(segment):
            if word in RUNTIME_WORDS:
                runs.append(run)
                run = []
            else:
                run.append(word)
        runs.append(run)
    return [run for run in runs if run]


def _code_phrases() -> tuple[set[tuple[str, ...]], set[str]]:
    """Every sequence of up to _MAX_RUN consecutive words of a string constant of the code
    (an f-string's literal parts are constants of their own: no sequence spans a value),
    and the one-word constants (values such as "failed" that the code puts in a message)."""
    files = [*(ROOT / "mindspeed_rl").rglob("*.py"), *(ROOT / "tools").rglob("*.py"),
             *ROOT.glob("*.py"), ROOT / "tests" / "reward_verifiers_for_tests.py"]
    phrases, values = set(), set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                runs = _words(node.value)
                if (len(runs) == 1 and len(runs[0]) == 1 and node.value.strip() == runs[0][0]
                        and len(runs[0][0]) >= 4):  # not a joiner such as " or "
                    values.add(runs[0][0])  # a one-word constant ("failed"): a value
                for run in runs:
                    for i in range(len(run)):
                        for j in range(i + 1, min(len(run), i + _MAX_RUN) + 1):
                            phrases.add(tuple(run[i:j]))
    return phrases, values


def _table_messages(text: str) -> list[str]:
    """The backquoted texts of the third column (the message / last line) of each table."""
    messages = []
    for line in text.splitlines():
        if not line.startswith("| ") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) >= 4 and cells[0] not in ("fault", "#"):
            messages += re.findall(r"`([^`]+)`", cells[2])
    return messages


def _uncovered(run: list[str], phrases: set, values: set) -> bool:
    """Whether ``run`` (words between two values of a documented message) cannot be cut
    into phrases of the code. A phrase of one word counts only where the code may have
    put a value beside it: at either end of a run of three or more words, or as the whole
    run; a word that is itself a one-word constant of the code splits the run."""
    for i, word in enumerate(run):
        if word in values:  # a value the code fills in: the words beside it are runs
            return any(_uncovered(part, phrases, values) for part in (run[:i], run[i + 1:])
                       if part)
    n = len(run)
    if n == 1:
        return (run[0],) not in phrases
    reachable = [True] + [False] * n  # reachable[k]: run[:k] is cut into phrases
    for k in range(n):
        if not reachable[k]:
            continue
        for j in range(k + 1, min(n, k + _MAX_RUN) + 1):
            single_ok = n >= 3 and (k == 0 or j == n)
            if (j - k >= 2 or single_ok) and tuple(run[k:j]) in phrases:
                reachable[j] = True
    return not reachable[n]


def test_every_documented_message_is_produced_by_the_code():
    messages = _table_messages(DOC.read_text(encoding="utf-8"))
    assert len(messages) > 60  # the tables were found
    phrases, values = _code_phrases()
    stale = {m: bad for m in messages
             if (bad := [" ".join(r) for r in _words(m) if _uncovered(r, phrases, values)])}
    assert not stale, "messages in docs/reliability.md the code does not produce: " + "; ".join(
        f"{m[:80]!r} (not in the code: {bad})" for m, bad in stale.items())
