"""The structure measures of the library (docs/architecture.md), checked on the source so
they cannot drift: no import cycle between modules, no function over 80 lines, no package
``__init__.py`` over 30 lines of code (docstring, comments and blank lines not counted),
and the feature switches read in one place (``mindspeed_rl/config/features.py``) instead
of being re-tested across the code. The layers themselves are import-linter's contracts
(``pyproject.toml``, run by ``shell/run_tests.sh``). Pure Python (``ast``), no import of
the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mindspeed_rl"
MAX_FUNCTION_LINES, MAX_INIT_LINES = 80, 30

# The feature switches: read (as attributes) only where the features are declared; a check
# of the key's own range reads it there too. Names in strings and docstrings are not reads.
SWITCHES = {"multi_turn_enable", "async_engine", "router_replay", "partial_rollout_max_split",
            "filter_groups_enable"}
SWITCHES_READ_IN = {"config/features.py", "config/schema.py"}
# The keys' own checks (their ranges and the keys they need), by concern
SWITCH_CHECKS = {"partial_rollout_max_split": "check_partial_rollout"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports at module level (``from a import b`` counts the
    submodule a.b when there is one, else a)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            for a in node.names:
                target = f"{base}.{a.name}"
                out.add(target if target in modules else base)
    return {m for m in out if m in modules and m != name}


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # a package imports its __init__'s imports; a submodule import runs the package first,
    # which is not a cycle of the submodule's own
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    return out


def switch_reads(source: str, where: str, allowed: dict[str, str] | None = None) -> list[str]:
    """``where:line: .switch`` for each attribute read of a feature switch in ``source``,
    outside the functions ``allowed`` maps a switch to (its own range check)."""
    out = []
    tree = ast.parse(source)
    owners = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                owners.setdefault(id(node), fn.name)
    reads = sorted((node.lineno, node.col_offset, node) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in SWITCHES
                   and _on_rl_config(node.value))
    for line, _, node in reads:
        if (allowed or {}).get(node.attr) != owners.get(id(node)):
            out.append(f"{where}:{line}: .{node.attr}")
    return out


def _on_rl_config(value: ast.expr) -> bool:
    """``rl.x``, ``ctx.rl.x``, ``config.rl_config.x``: a read of the rl_config section."""
    return (isinstance(value, ast.Name) and value.id in ("rl", "rl_config")) or \
        (isinstance(value, ast.Attribute) and value.attr in ("rl", "rl_config"))


def switch_tests() -> list[str]:
    out = []
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE))
        if where not in SWITCHES_READ_IN:
            out += switch_reads(path.read_text(), where, SWITCH_CHECKS)
    return out


def init_code_lines(path: Path) -> int:
    """Lines of code of a module: not blank, not a comment, not its docstring."""
    tree = ast.parse(path.read_text())
    docstring = range(0)
    if tree.body and isinstance(tree.body[0], ast.Expr) and \
            isinstance(tree.body[0].value, ast.Constant):
        docstring = range(tree.body[0].lineno, tree.body[0].end_lineno + 1)
    return sum(1 for number, line in enumerate(path.read_text().splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstring)


def test_no_import_cycles():
    cycles = import_cycles(_modules())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_function_over_80_lines():
    assert not long_functions(), "\n".join(long_functions())


def test_no_package_init_over_30_lines():
    long = [f"{p.relative_to(ROOT)} ({init_code_lines(p)})" for p in PACKAGE.rglob("__init__.py")
            if init_code_lines(p) > MAX_INIT_LINES]
    assert not long, long


def test_feature_switches_are_read_in_one_place():
    """``config.features`` says which optional parts a job runs; code elsewhere asks it."""
    assert not switch_tests(), "\n".join(switch_tests())


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The measures are not vacuous: each finds a planted violation."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pkg import b\n")
    b.write_text("import pkg.a\n")
    assert import_cycles({"pkg.a": a, "pkg.b": b}) == [["pkg.a", "pkg.b", "pkg.a"]]
    planted = ('"""``rl_config.multi_turn_enable`` in a docstring is not a read."""\n'
               "def f(rl, config):\n"
               "    if rl.partial_rollout_max_split > 1 and config.rl_config.multi_turn_enable:\n"
               '        raise ValueError("set rl_config.async_engine: false")\n'
               '    return rl.router_replay == "R3"\n'
               "def check_partial_rollout(rl):\n"
               "    return rl.partial_rollout_max_split >= 1\n")
    assert switch_reads(planted, "x.py", SWITCH_CHECKS) == [
        "x.py:3: .partial_rollout_max_split", "x.py:3: .multi_turn_enable",
        "x.py:5: .router_replay"]
    assert not switch_reads("def g(features, r):\n    return features.router_replay, "
                            "r.router_replay\n", "y.py")  # not the rl_config section
    init = tmp_path / "__init__.py"
    init.write_text('"""doc\n\nmore doc"""\n\n# a comment\nimport os\nx = 1\n')
    assert init_code_lines(init) == 2
    assert long_functions(limit=3)  # the library has functions over 3 lines
