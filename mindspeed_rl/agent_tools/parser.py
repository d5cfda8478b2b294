"""Tool calls found in the model's text (hermes format) and tool responses cut to size.

Hermes is the format Qwen2.5's chat template teaches the model::

    <tool_call>
    {"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}
    </tool_call>

The text is model output, i.e. untrusted input that can be long and adversarial, so
the blocks are found with ``str.find`` from left to right (each character is looked at
a bounded number of times: linear time, no regex backtracking) and a block that does not
parse becomes an error string for the model, never an exception in the trainer.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

START, END = "<tool_call>", "</tool_call>"
_SHOWN = 200  # characters of a malformed block quoted back to the model


@dataclass
class ToolCall:
    """One call: the function name, its arguments, and the text between the tags."""

    name: str
    arguments: dict
    raw: str


@dataclass
class ParseResult:
    """The calls of one model turn, and one error text per block that is not a call
    (the agent loop returns each error to the model as that call's tool response)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_hermes(text: str) -> ParseResult:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order.

    A block holds a JSON object with ``name`` (a string) and ``arguments`` (an object, or
    a string holding a JSON object, as some models write it; absent = no arguments). A
    ``<tool_call>`` without its ``</tool_call>`` is an error too: the model stopped with
    an unfinished call.
    """
    result = ParseResult()
    position = 0
    while True:
        start = text.find(START, position)
        if start < 0:
            return result
        end = text.find(END, start + len(START))
        if end < 0:
            result.errors.append(f"Error: {START} without {END}; write each call as "
                                 f"{START}{{\"name\": ..., \"arguments\": {{...}}}}{END}")
            return result
        raw = text[start + len(START):end]
        call = _call(raw)
        if isinstance(call, ToolCall):
            result.calls.append(call)
        else:
            result.errors.append(call)
        position = end + len(END)


def tool_parser(name: str) -> Callable[[str], ParseResult]:
    """``rl_config.tool_parser_format``: ``hermes``, or ``package.module:function`` (your own
    format: text -> ParseResult). A name that does not resolve to a callable is a ValueError
    that says why."""
    if name == "hermes":
        return parse_hermes
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError("is not a known format; use hermes, or package.module:function for a "
                         "parser of your own")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"does not resolve ({type(e).__name__}: {e}); check the module path "
                         "(importable from the job's working directory) and the function name"
                         ) from None
    if not callable(fn):
        raise ValueError(f"names a {type(fn).__name__}, not a function (text -> ParseResult)")
    return fn


def _call(raw: str) -> ToolCall | str:
    """The call written in ``raw``, or the error text for the model."""
    shown = raw.strip()
    shown = shown if len(shown) <= _SHOWN else shown[:_SHOWN] + "..."
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than json's stack
        return f"Error: the tool call is not valid JSON ({_reason(e)}): {shown}"
    if not isinstance(value, dict):
        return f"Error: the tool call must be a JSON object with name and arguments: {shown}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f"Error: the tool call has no \"name\": {shown}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            return f"Error: the arguments of {name!r} are not valid JSON ({_reason(e)}): {shown}"
    if not isinstance(arguments, dict):
        return f"Error: the arguments of {name!r} must be a JSON object: {shown}"
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _reason(error: Exception) -> str:
    return error.msg if isinstance(error, json.JSONDecodeError) else type(error).__name__


# MindSpeed-RL's markers (tool_utils.get_tool_response): the model trained with the recipe
# has seen these exact strings.
_LEFT_MARK, _RIGHT_MARK, _MIDDLE_MARK = "...(truncated)", "(truncated)...", "...(truncated)..."
TRUNCATE_SIDES = ("left", "right", "middle")


def truncate(text: str, max_chars: int, side: str) -> str:
    """``text`` cut to ``max_chars`` characters (characters, not tokens, as MindSpeed-RL's
    ``max_tool_response_length``), with a marker where text was removed.

    ``side`` names the part that is KEPT (MindSpeed-RL's meaning): ``left`` keeps the
    beginning (``text[:max_chars] + "...(truncated)"``), ``right`` keeps the end
    (``"(truncated)..." + text[-max_chars:]``), ``middle`` keeps both ends and cuts the
    middle (``head + "...(truncated)..." + tail``). The marker is not counted in
    ``max_chars``. Text of at most ``max_chars`` characters is returned unchanged.
    """
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {side!r}: one of {TRUNCATE_SIDES}")
    if max_chars < 0:
        raise ValueError(f"truncate max_chars={max_chars}: must be >= 0")
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + _LEFT_MARK
    if side == "right":
        return _RIGHT_MARK + text[len(text) - max_chars:]
    head = max_chars // 2
    # len - (max - head), not text[-tail:]: with tail == 0 that would keep the whole text.
    return text[:head] + _MIDDLE_MARK + text[len(text) - (max_chars - head):]
