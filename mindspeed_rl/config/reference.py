"""The key reference of docs/config.md, generated from the schema (so the two never drift).

    python -m mindspeed_rl.config.reference            # print it
    python -m mindspeed_rl.config.reference --write    # rewrite docs/config.md's section

Each section's table lists every key with its type, default and the documentation the
schema carries (``setting(doc=...)``); keys marked (path) resolve against the working
directory.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from mindspeed_rl.config.schema import OPTIONAL_SECTIONS, SECTIONS
from mindspeed_rl.config.typed_sections import field_types, nested_section_type

HEADING = "### Key reference"
INTRO = ("Defaults describe a small CPU run. Keys marked (path) resolve against the working\n"
         "directory. `critic_config` and `reward_config` are optional sections: without them "
         "the job\nhas no critic (GRPO) and no reward model.")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or null"
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is tuple:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "**required**"
    value = f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return f"`{list(value)}`".replace("'", "")
    return f"`{value}`"


def _table(cls: type, title: str, note: str = "") -> list[str]:
    hints = field_types(cls)
    lines = [f"#### `{title}`{note}", "", "| key | type | default | meaning |",
             "| --- | --- | --- | --- |"]
    nested = []
    for f in dataclasses.fields(cls):
        sub = nested_section_type(hints[f.name])
        if sub is not None:
            nested.append((sub, f"{title}.{f.name}"))
            continue
        doc = f.metadata.get("doc", "") + (" (path)" if f.metadata.get("path") else "")
        doc = doc.replace("|", "\\|")
        lines.append(f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {doc} |")
    out = lines + [""]
    for sub, name in nested:
        out += _table(sub, name)
    return out


def key_reference() -> str:
    """The markdown of docs/config.md from ``### Key reference`` to its end."""
    lines = [HEADING, "", INTRO, ""]
    for name, cls in SECTIONS.items():
        lines += _table(cls, name, " (optional)" if name in OPTIONAL_SECTIONS else "")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = key_reference()
    if argv == ["--write"]:
        path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
        docs = path.read_text()
        path.write_text(docs[:docs.index(HEADING)] + text)
        print(f"wrote {path}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
