"""`ConfigError`: what is wrong with a job configuration, in one line a user can act on;
and `require`, the checks' way to raise it."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

_NO_VALUE = object()


def show_value(value: Any) -> str:
    """A value as the user would write it in YAML (lists, not tuples; strings quoted)."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return repr(value)


class ConfigError(ValueError):
    """A configuration that cannot run: names the dotted key, the value and the fix.

    Raised while loading (unknown keys, wrong types, inconsistent sizes) and by the
    dry-run plan (layouts that do not tile the world); always before any process
    group exists, so every rank fails the same way with the same message.
    """

    def __init__(self, key: str | None, problem: str, fix: str | None = None, *,
                 value: Any = _NO_VALUE, origin: str | None = None):
        self.key = key
        self._value = value
        self.value = None if value is _NO_VALUE else value
        self.problem = problem
        self.fix = fix
        self.origin = origin
        head = key or ""
        if key is not None and value is not _NO_VALUE:
            head += f"={show_value(value)}"
        if origin:
            head += f" ({origin})"
        message = f"{head}: {problem}" if head else problem
        if fix:
            message += f"; {fix}"
        super().__init__(message)

    def with_fix(self, extra: str) -> ConfigError:
        """The same error with ``extra`` appended to its fix."""
        fix = f"{self.fix}; {extra}" if self.fix else extra
        return ConfigError(self.key, self.problem, fix, value=self._value, origin=self.origin)


def require(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
    """Raise `ConfigError` (``key``, ``value``, ``problem``, ``fix``) unless ``ok``: the one
    line each check of `mindspeed_rl.config.checks` states its rule in."""
    if not ok:
        raise ConfigError(key, problem, fix, value=value)


class ConfigErrors(ConfigError):
    """Several problems of one config file, reported together (one line each).

    ``errors`` holds the individual `ConfigError`s; ``key`` is the first one's.
    """

    def __init__(self, errors: list[ConfigError], where: str):
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        if len(self.errors) == 1:
            ConfigError.__init__(self, first.key, first.problem, first.fix,
                                 value=first._value, origin=first.origin)
            return
        self.key, self._value, self.value = first.key, first._value, first.value
        self.problem, self.fix, self.origin = first.problem, first.fix, first.origin
        lines = "".join(f"\n  - {e}" for e in self.errors)
        ValueError.__init__(self, f"{len(self.errors)} problems in {where}:{lines}")

    def with_fix(self, extra: str) -> ConfigError:
        return self


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str | None:
    """``did you mean <prefix><closest>?`` for a misspelt name, or None when nothing is close."""
    # a close misspelling only: a looser match offers keys that merely share words
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.85)
    return f"did you mean {prefix}{matches[0]}?" if matches else None
