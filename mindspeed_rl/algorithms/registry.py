"""The algorithm registry: every algorithm family and advantage estimator, by name.

The config's allowed values (``--algorithm``, MindSpeed-RL's ``stage``,
``rl_config.adv_estimator`` and its aliases), the dry run's checks and the trainer's
phase lists are read from here. Each family and estimator registers itself where it is
defined (``register(Algorithm(...))``, ``@register_estimator(...)``, as verl's
``register_adv_est``); importing ``mindspeed_rl.algorithms`` imports the modules that
define them. A new estimator is one module (docs/algorithms.md has a worked example).
"""

from __future__ import annotations

from typing import Callable

from mindspeed_rl.algorithms.estimator import Estimator
from mindspeed_rl.algorithms.family import Algorithm

_ALGORITHMS: dict[str, Algorithm] = {}
_ESTIMATORS: dict[str, Estimator] = {}


def register(item: Algorithm | Estimator) -> Algorithm | Estimator:
    """Add a family or an estimator; its name (and an estimator's aliases) must be new."""
    if isinstance(item, Algorithm):
        table, names = _ALGORITHMS, (item.name,)
    else:
        table, names = _ESTIMATORS, (item.name, *item.aliases)
    taken = [n for n in names if n in table or (table is _ESTIMATORS and _alias_owner(n))]
    if taken:
        raise ValueError(f"{type(item).__name__} name {taken[0]!r} is already registered")
    table[item.name] = item
    return item


def register_estimator(name: str, **declaration) -> Callable:
    """Decorator: register the decorated ``fn(x, sums, **params) -> AdvantageOutputs`` as
    the estimator ``name`` (``declaration``: the other `Estimator` fields); returns ``fn``."""
    def wrap(fn: Callable) -> Callable:
        register(Estimator(name=name, fn=fn, **declaration))
        return fn
    return wrap


def unregister(name: str) -> None:
    """Remove a family or an estimator (tests that register an example)."""
    _ALGORITHMS.pop(name, None)
    _ESTIMATORS.pop(name, None)


def _alias_owner(name: str) -> Estimator | None:
    return next((e for e in _ESTIMATORS.values() if name in e.aliases), None)


def algorithms() -> tuple[Algorithm, ...]:
    return tuple(_ALGORITHMS.values())


def algorithm(name: str) -> Algorithm:
    """The family called ``name`` (a launcher's ``algorithm``)."""
    if name not in _ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is not one of {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[name]


def algorithm_of_stage(stage: str) -> Algorithm | None:
    """The family that runs MindSpeed-RL's ``stage`` (None: no family does)."""
    return next((a for a in _ALGORITHMS.values() if stage in a.stages), None)


def stages() -> list[str]:
    return sorted(s for a in _ALGORITHMS.values() for s in a.stages)


def estimators(algorithm_name: str | None = None) -> tuple[Estimator, ...]:
    """Every estimator, or those the family ``algorithm_name`` runs (its default first)."""
    if algorithm_name is None:
        return tuple(_ESTIMATORS.values())
    default = algorithm(algorithm_name).default_estimator
    runs = [e for e in _ESTIMATORS.values() if algorithm_name in e.algorithms]
    return tuple(sorted(runs, key=lambda e: e.name != default))


def estimator(name: str | None) -> Estimator | None:
    """The estimator called ``name`` or aliased so (None: no such estimator)."""
    if name is None:
        return None
    return _ESTIMATORS.get(name) or _alias_owner(name)


def advantage_phases() -> frozenset[str]:
    """The phases that compute advantages: a recipe runs only its estimator's."""
    return frozenset(e.phase for e in _ESTIMATORS.values())


def phases(algorithm_name: str, estimator_name: str | None) -> tuple[str, ...]:
    """The phase names of ``algorithm_name`` running ``estimator_name``, in order (every
    phase the job may need; the trainer leaves out those a config does not)."""
    found = estimator(estimator_name)
    skip = advantage_phases() - ({found.phase} if found is not None else set())
    return tuple(n for n in algorithm(algorithm_name).phases if n not in skip)

