"""What one tool call returns, whichever backend ran it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ToolResult:
    """The text the model sees as the tool response, and how the call ended.

    At most one of ``ok``, ``timed_out`` and ``error`` is true: ``ok`` the code ran and
    exited 0; ``timed_out`` it ran past its time limit (wall clock or CPU) and was
    stopped; ``error`` anything else (an exception, a nonzero exit, a signal, a limit, a
    call the pool could not run, a sandbox service that failed). ``seconds`` is the wall
    time of the call.
    """

    text: str
    ok: bool
    timed_out: bool
    error: bool
    seconds: float

    @classmethod
    def failed(cls, text: str, seconds: float = 0.0) -> "ToolResult":
        return cls(text=text, ok=False, timed_out=False, error=True, seconds=seconds)

    @classmethod
    def timeout(cls, text: str, seconds: float) -> "ToolResult":
        return cls(text=text, ok=False, timed_out=True, error=False, seconds=seconds)


def timeout_text(limit_s: float, output: str = "", how: str = "") -> str:
    """The tool response of a call past its limit: what it printed, then the error line."""
    line = f"Error: execution timed out after {limit_s:g} s{how}"
    return f"{output.rstrip()}\n{line}" if output.strip() else line
