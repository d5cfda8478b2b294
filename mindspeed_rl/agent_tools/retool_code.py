"""ReTool's conventions for the code a model passes (``config.code_format: retool``).

MindSpeed-RL's ``ReTool`` tool (1) runs the first fenced block when the argument holds
a Markdown ```` ```python ```` fence and (2) prints the last line when it is not a
``print``, so ``x = 2\\nx ** 10`` answers ``1024`` like a notebook cell. Their rule
wraps the last non-empty line whatever it is, which turns ``    total += i`` (the end of
a loop) or ``y = 3`` into a SyntaxError; here only a last top-level *expression*
statement that is not already a ``print(...)`` call is wrapped (the Python parser
decides), and code that does not parse is left for the interpreter to report.
"""

from __future__ import annotations

import ast
import io

_FENCE = "```python"


def prepare_code(code: str) -> str:
    """``code`` with ReTool's conventions applied."""
    code = _first_fenced_block(code)
    return _print_last_expression(code)


def _first_fenced_block(code: str) -> str:
    start = code.find(_FENCE)
    if start < 0:
        return code
    end = code.find("```", start + len(_FENCE))
    if end < 0:
        return code
    return code[start + len(_FENCE):end].strip()


def _print_last_expression(code: str) -> str:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    last = tree.body[-1]
    call = last.value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
        return code
    # Split where the parser counts lines (\n, \r\n, \r), not at str.splitlines' \f, \u2028...
    lines = io.StringIO(code, newline="").readlines()
    # ast offsets: 1-based line numbers, columns in UTF-8 bytes.
    first, final = lines[last.lineno - 1], lines[last.end_lineno - 1]
    begin = len(first.encode()[:last.col_offset].decode(errors="ignore"))
    stop = len(final.encode()[:last.end_col_offset].decode(errors="ignore"))
    if last.lineno == last.end_lineno:
        wrapped = first[:begin] + "print(" + first[begin:stop] + ")" + first[stop:]
        return "".join(lines[:last.lineno - 1] + [wrapped] + lines[last.lineno:])
    head = first[:begin] + "print(" + first[begin:]
    tail = final[:stop] + ")" + final[stop:]
    return "".join(lines[:last.lineno - 1] + [head] + lines[last.lineno:last.end_lineno - 1]
                   + [tail] + lines[last.end_lineno:])
