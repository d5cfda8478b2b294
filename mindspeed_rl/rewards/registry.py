"""Rule-based verifiers by name (the weighted reward of a batch is ``scoring.py``'s).

A verifier is ``fn(response_text: str, answer: str) -> float``; it never raises
on model output (malformed, empty) or a missing answer: those score 0.0. The
YAML names them in ``rl_config.verifier_function`` with one weight each in
``rl_config.verifier_weight``.
"""

from __future__ import annotations

from collections.abc import Callable

Verifier = Callable[[str, str], float]

_VERIFIERS: dict[str, Verifier] = {}
_FAILED_SCORES: dict[str, float] = {}


def register_verifier(name: str, *, failed_score: float = 0.0
                      ) -> Callable[[Verifier], Verifier]:
    """Decorator: make ``fn`` available as ``rl_config.verifier_function: [name]``.

    failed_score: the verifier's lowest score, given to a call that timed out or raised
    in a reward worker (unless rl_config.reward_failed_score sets one for all).
    """
    def register(fn: Verifier) -> Verifier:
        if name in _VERIFIERS and _VERIFIERS[name] is not fn:
            raise ValueError(f"verifier {name!r} is already registered "
                             f"({_VERIFIERS[name].__module__}.{_VERIFIERS[name].__name__})")
        _VERIFIERS[name] = fn
        _FAILED_SCORES[name] = float(failed_score)
        return fn
    return register


def failed_score(name: str) -> float:
    """The score of a call of verifier ``name`` that timed out or raised."""
    get_verifier(name)
    return _FAILED_SCORES[name]


def registered_verifiers() -> list[str]:
    """Names of all registered verifiers, sorted."""
    return sorted(_VERIFIERS)


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return _VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r} in rl_config.verifier_function; registered "
                         f"verifiers are {registered_verifiers()}") from None
