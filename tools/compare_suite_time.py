"""The test suite's time at two commits, side by side (docs/testing.md).

    git clone -q . /tmp/A && git -C /tmp/A checkout -q OLD
    git clone -q . /tmp/B && git -C /tmp/B checkout -q NEW
    python tools/compare_suite_time.py /tmp/A /tmp/B [--times T.json] [--chunks 10] \\
        [--out suite_ab.json]

On a machine whose speed drifts by 15 % an hour (and some days by 2x), a suite time is only
comparable with one taken beside it. Each clone's environment is set up first
(``shell/setup_env.sh``, byte-compilation and the import layers, as ``shell/run_tests.sh``
does; timed), then the test modules of both clones are split into ``--chunks`` groups of
about equal time (``--times``: a ``MINDSPEED_RL_TEST_TIMES`` file of an earlier run; else
every module counts alike), and each group runs with pytest in A and in B back to back,
the order alternating (A B, B A, ...). A module that exists in one clone only runs there.
Prints one JSON line (and rewrites ``--out`` after every group): the seconds of each group
at each side, the totals and B / A.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SETUP = ("bash shell/setup_env.sh && .venv/bin/python -m compileall -q -j 0 mindspeed_rl tests "
         "benchmarks tools >/dev/null && PYTHONPATH=$PWD .venv/bin/lint-imports --no-cache "
         "--no-logo")


def modules(clone: Path) -> set[str]:
    return {p.name for p in (clone / "tests").glob("test_*.py")}


def chunks(names: set[str], weights: dict[str, float], n: int) -> list[list[str]]:
    """``names`` in ``n`` groups of about equal weight (the heaviest first, each to the
    lightest group)."""
    groups, load = [[] for _ in range(n)], [0.0] * n
    for name in sorted(names, key=lambda m: (-weights.get(m, 30.0), m)):
        i = load.index(min(load))
        groups[i].append(name)
        load[i] += weights.get(name, 30.0)
    return [g for g in groups if g]


def _timed(clone: Path, cmd: list[str], log: Path) -> tuple[float, int]:
    start = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=clone, stdout=out, stderr=subprocess.STDOUT).returncode
    return time.perf_counter() - start, rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--times", type=Path, help="per-test seconds of an earlier run (balancing)")
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("suite_ab.json"))
    p.add_argument("--logs", type=Path, default=Path("suite_ab_logs"))
    args = p.parse_args(argv)
    for clone in (args.a, args.b):
        if not (clone / "tests").is_dir():
            p.error(f"{clone} is not a clone of this project (no tests/ folder)")
    weights: dict[str, float] = {}
    if args.times:
        for test, seconds in json.loads(args.times.read_text())["tests"].items():
            name = test.split("::")[0].split("/")[-1]
            weights[name] = weights.get(name, 0.0) + seconds
    args.logs.mkdir(parents=True, exist_ok=True)
    sides = {"A": args.a, "B": args.b}
    result = {"A": str(args.a), "B": str(args.b), "setup": {}, "chunks": []}
    for name, clone in sides.items():
        result["setup"][name] = _timed(clone, ["bash", "-c", SETUP], args.logs / f"setup_{name}.log")
    for i, group in enumerate(chunks(modules(args.a) | modules(args.b), weights, args.chunks)):
        entry = {"modules": group}
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
            have = modules(sides[name])
            tests = [f"tests/{m}" for m in group if m in have]
            entry[name] = _timed(sides[name], [".venv/bin/python", "-m", "pytest", "-p",
                                               "no:cacheprovider", "-q", *tests],
                                 args.logs / f"chunk{i}_{name}.log")
        result["chunks"].append(entry)
        args.out.write_text(json.dumps(result, indent=1))
    total = {n: sum(c[n][0] for c in result["chunks"]) for n in sides}
    result.update(suite_s=total, ratio_b_over_a=total["B"] / total["A"],
                  failed_chunks=[i for i, c in enumerate(result["chunks"])
                                 if c["A"][1] or c["B"][1]])
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("suite_s", "ratio_b_over_a", "setup",
                                             "failed_chunks")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
