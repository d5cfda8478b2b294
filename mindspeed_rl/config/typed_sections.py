"""Turning parsed YAML mappings into the typed config dataclasses, key by key.

The dataclass field annotations are the schema: ``int``, ``float``, ``bool``,
``str``, ``X | None``, ``Literal[...]``, ``tuple[X, ...]`` (YAML lists) and
nested dataclasses (YAML mappings). Every rejection names the dotted key, the
value and what to write instead.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import yaml

from mindspeed_rl.config.config_error import ConfigError, did_you_mean


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a config dataclass (the modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def nested_section_type(tp: Any) -> type | None:
    """The dataclass type of a nested section field, or None for a plain key."""
    return tp if dataclasses.is_dataclass(tp) else None


def build_section(cls: type, raw: Any, prefix: str, *, overridden: frozenset[str] = frozenset(),
                  ignore_unknown: bool = False, allowed_extra: frozenset[str] = frozenset(),
                  source: str | None = None, given: dict[str, Any] | None = None,
                  elsewhere: dict[str, str] | None = None):
    """Build ``cls`` from the mapping ``raw`` found at dotted ``prefix``.

    Unknown keys are errors (with a did-you-mean) unless ``ignore_unknown`` (HF
    config.json files carry many keys this code does not need) or listed in
    ``allowed_extra``. Keys in ``overridden`` came from the command line, which
    the error says so the user looks in the right place; ``source`` names the
    file otherwise. ``given`` are fields the caller fills (not read from ``raw``).
    ``elsewhere`` maps keys of other sections to their dotted names, so a key
    written in the wrong section is pointed to the right one.
    """
    given = given or {}
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"expected a mapping of keys (section), got {type(raw).__name__}",
                          f"write '{prefix.rsplit('.', 1)[-1]}:' followed by indented key: value lines",
                          value=raw)
    hints = field_types(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in given}
    if not ignore_unknown:
        for key in raw:
            if key not in known and key not in allowed_extra:
                dotted = f"{prefix}.{key}"
                if elsewhere and key in elsewhere:
                    hint = f"it belongs in another section: did you mean {elsewhere[key]}?"
                else:
                    hint = did_you_mean(str(key), known, f"{prefix}.")
                if hint is None:
                    hint = f"known keys: {', '.join(sorted(known))}"
                raise ConfigError(dotted, "unknown key", hint,
                                  origin=_origin(dotted, overridden, source))
    kwargs = dict(given)
    for name, f in known.items():
        dotted = f"{prefix}.{name}"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in raw and raw[name] is None and required:
            # a key written blank (`data_path:`), as templates ship it: still missing
            raise ConfigError(dotted, "required key is empty",
                              f"set it under {prefix}: ({f.metadata.get('doc', '')})",
                              value=None, origin=_origin(dotted, overridden, source))
        if name in raw:
            kwargs[name] = coerce_value(raw[name], hints[name], dotted, overridden=overridden,
                                        example=f.default, source=source,
                                        doc=f.metadata.get("doc"), elsewhere=elsewhere)
        elif required:
            raise ConfigError(dotted, "required key is missing",
                              f"add it under {prefix}: ({f.metadata.get('doc', '')})",
                              origin=source)
    return cls(**kwargs)


def _origin(dotted: str, overridden: frozenset[str], source: str | None) -> str | None:
    return "command-line override" if dotted in overridden else source


def _type_error(value: Any, dotted: str, expected: str, example: Any,
                overridden: frozenset[str], source: str | None) -> ConfigError:
    name = dotted.rsplit(".", 1)[-1]
    if example is not dataclasses.MISSING and example is not None and example != ():
        shown = list(example) if isinstance(example, tuple) else example
        fix = f"e.g. {name}: {yaml.safe_dump(shown, default_flow_style=True).splitlines()[0]}"
    elif expected.startswith("a list"):
        fix = f"write a list, e.g. [{value}]"
    elif expected == "a string":
        fix = "put the value in quotes"
    else:
        fix = f"write {expected}"
    if isinstance(value, str) and _is_quoted_literal(value, expected):
        fix += " (without quotes)"
    return ConfigError(dotted, f"expected {expected}, got {type(value).__name__}", fix,
                       value=value, origin=_origin(dotted, overridden, source))


def _is_quoted_literal(text: str, expected: str) -> bool:
    """'8' or "true" written in quotes where a number or a bool was meant."""
    if expected == "true or false":
        return text.lower() in ("true", "false")
    if expected in ("an integer", "a number"):
        try:
            float(text)
        except ValueError:
            return False
        return True
    return False


def coerce_value(value: Any, tp: Any, dotted: str, *, overridden: frozenset[str] = frozenset(),
                 example: Any = dataclasses.MISSING, source: str | None = None,
                 doc: str | None = None, elsewhere: dict[str, str] | None = None) -> Any:
    """Check ``value`` against annotation ``tp``; return it in canonical form (ints as floats
    for float keys, lists as tuples). ``doc`` explains the key in a choice error."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        *first, last = [a for a in args if a is not type(None)]
        for inner in first:  # ``str | tuple[str, ...]``: the first type that takes the value
            try:
                return coerce_value(value, inner, dotted, overridden=overridden,
                                    source=source, doc=doc, elsewhere=elsewhere)
            except ConfigError:
                pass
        return coerce_value(value, last, dotted, overridden=overridden, example=example,
                            source=source, doc=doc, elsewhere=elsewhere)
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        choices = ", ".join(map(str, args))
        hint = did_you_mean(str(value), [str(a) for a in args])
        fix = f"use one of: {choices}" + (f" ({hint})" if hint else "") + (
            f" [{doc}]" if doc else "")
        raise ConfigError(dotted, "not an accepted value", fix, value=value,
                          origin=_origin(dotted, overridden, source))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _type_error(value, dotted, f"a list of {_type_name(args[0])}s",
                              example, overridden, source)
        items = [f"{dotted}[{i}]" for i in range(len(value))]
        if dotted in overridden:   # the elements came from the command line too
            overridden = overridden | frozenset(items)
        return tuple(coerce_value(v, args[0], item, overridden=overridden, source=source)
                     for item, v in zip(items, value))
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, dotted, overridden=overridden, source=source,
                             elsewhere=elsewhere)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(value, dotted, "true or false", example, overridden, source)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(value, dotted, "an integer", example, overridden, source)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(value, dotted, "a number", example, overridden, source)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(value, dotted, "a string", example, overridden, source)
    raise TypeError(f"config schema uses an unsupported annotation {tp!r} for {dotted}")


def _type_name(tp: Any) -> str:
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))
