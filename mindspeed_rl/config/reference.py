"""The generated parts of docs/config.md, so they never drift from the code:

- the key reference, from the schema (each key's type, default and ``setting(doc=...)``);
- the MindSpeed-RL key tables, from ``mindspeed_keys.ROWS``.

    python -m mindspeed_rl.config.reference            # print both
    python -m mindspeed_rl.config.reference --write    # rewrite them in docs/config.md
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
         "directory. `critic_config`, `reward_config` and `teacher_config` are optional "
         "sections: without them the job\nhas no critic (GRPO), no reward model and no "
         "distillation teacher (docs/algorithms.md).")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        null = " or null" if type(None) in args else ""
        return " or ".join(_type_name(a) for a in inner) + null
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
        kind = _type_name(hints[f.name]).replace("|", "\\|")
        lines.append(f"| `{f.name}` | {kind} | {_default(f)} | {doc} |")
    out = lines + [""] if len(lines) > 4 else []  # a section of sections: its tables only
    for sub, name in nested:
        out += _table(sub, name)
    return out


def key_reference() -> str:
    """The markdown of docs/config.md from ``### Key reference`` to its end."""
    lines = [HEADING, "", INTRO, ""]
    for name, cls in SECTIONS.items():
        lines += _table(cls, name, " (optional)" if name in OPTIONAL_SECTIONS else "")
    return "\n".join(lines).rstrip() + "\n"


# The MindSpeed-RL tables sit between these two headings of docs/config.md.
MINDSPEED_START = "#### top level"
MINDSPEED_END = "#### MindSpeed-RL model yamls"


def mindspeed_tables() -> str:
    """How every MindSpeed-RL key is handled, one table per family (``ROWS``)."""
    from mindspeed_rl.config.mindspeed_keys import (GENERATE, HONOURED, MEGATRON,
                                                    NOT_APPLICABLE, RL, ROWS, SAMPLING, TOP)

    titles = {TOP: (MINDSPEED_START, None),
              MEGATRON: ("#### `megatron_training` / `actor_config` (Megatron keys; "
                         "MindSpeed-RL merges the two sections)", "megatron_training"),
              RL: ("#### `rl_config`", "rl_config"),
              GENERATE: ("#### `generate_config`", "generate_config"),
              SAMPLING: ("#### `generate_config.sampling_config`",
                         "generate_config.sampling_config")}
    lines = []
    for family, (title, home) in titles.items():
        rows = [r for r in ROWS if r.family == family and not r.history]
        lines += [title, ""]
        honoured = [f"`{r.name}`" + ("" if r.detail == f"{home}.{r.name}" else f" (`{r.detail}`)")
                    for r in rows if r.handling == HONOURED]
        if honoured:
            lines += ["Honoured, same name and meaning: " + ", ".join(honoured) + ".", ""]
        groups: list[tuple[tuple, list[str]]] = []
        for r in rows:
            if r.handling == HONOURED:
                continue
            accepted = (r.needs or "any") if r.handling == NOT_APPLICABLE else "-"
            key = (r.handling, r.detail, accepted)
            if groups and groups[-1][0] == key:
                groups[-1][1].append(r.name)
            else:
                groups.append((key, [r.name]))
        if groups:
            lines += ["| key | handling | why / what it becomes | values accepted |",
                      "| --- | --- | --- | --- |"]
            for (handling, detail, accepted), names in groups:
                keys = ", ".join(f"`{n}`" for n in names)
                lines.append(f"| {keys} | {handling} | {detail.replace('|', '/')} | {accepted} |")
            lines.append("")
    lines += ["#### Keys of older MindSpeed-RL versions", "",
              "Keys its config classes had and no longer have (or that its own early configs "
              "carried unread), with the versions that read them (dates of its master "
              "branch; 2.0.0 is its first release branch, 2025-05-30). Each loads as said, or "
              "is refused by name with its version.", "",
              "| key | section | MindSpeed-RL versions | handling | why / what it becomes | "
              "values accepted |", "| --- | --- | --- | --- | --- | --- |"]
    old: list[tuple[tuple, list[str]]] = []
    for r in (r for r in ROWS if r.history):
        accepted = (r.needs or "any") if r.handling == NOT_APPLICABLE else "-"
        key = (titles[r.family][1], r.history, r.handling, r.detail, accepted)
        if old and old[-1][0] == key:
            old[-1][1].append(r.name)
        else:
            old.append((key, [r.name]))
    for (section, history, handling, detail, accepted), names in old:
        keys = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| {keys} | `{section}` | {history} | {handling} | "
                     f"{detail.replace('|', '/')} | {accepted} |")
    lines += ["", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
        docs = path.read_text()
        start, end = docs.index(MINDSPEED_START), docs.index(MINDSPEED_END)
        docs = docs[:start] + mindspeed_tables() + docs[end:]
        path.write_text(docs[:docs.index(HEADING)] + key_reference())
        print(f"wrote {path}")
    else:
        print(mindspeed_tables() + "\n" + key_reference(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
