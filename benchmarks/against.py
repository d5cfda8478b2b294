"""``--against REV``: a benchmark of this checkout and of another commit, side by side.

A speed claim on a machine whose speed drifts by 15 % an hour (and some days by 2x) is a
ratio of two runs made together. This driver checks REV out into a temporary git worktree
and runs the benchmark script of each tree under torchrun, round by round, alternating
which tree goes first (this, REV; REV, this; ...). Both run from the caller's working
directory with the same arguments (config file, data, overrides): only the code differs.
It prints one JSON object: each side's medians over the rounds of every number its
benchmark printed, each side's per-round ``timing/all``, and ``ratio`` = this / REV for
the timings (below 1: this checkout is faster).

With ``--own-config`` each side reads the ``--config`` file from its own tree (the demo's
tuned config against the config as it was at REV); otherwise both read the caller's.

Used by ``bench_grpo.py --against REV [--rounds N] [--nproc N] [--own-config]`` (not under
torchrun).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from json_report import run_for_json  # benchmarks/ is on sys.path (bench_grpo.py)

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def revision(rev: str, cwd: Path = ROOT) -> str:
    """REV's full commit id; a clear error when the checkout does not have it."""
    try:
        return _git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=cwd)
    except subprocess.CalledProcessError:
        raise SystemExit(f"--against {rev}: not a commit of {cwd} (git rev-parse failed); "
                         "give a commit id, tag or branch this checkout has") from None


def run_side(tree: Path, script: str, args: list[str], nproc: int, log: Path) -> dict:
    """One benchmark run of ``tree``'s ``script`` under torchrun; its JSON (last stdout line)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), str(tree / script), *args]
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run_for_json(cmd, log, what=f"--against: {tree / script}", env=env)


def _numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a benchmark's JSON, nested dicts flattened to ``outer/inner`` keys."""
    out = {}
    for key, value in result.items():
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


def side_by_side(rev: str, script: str, args: list[str], *, rounds: int, nproc: int,
                 run: Callable[[Path, str, list[str], int, Path], dict] = run_side,
                 repo: Path = ROOT, own_config: str | None = None) -> dict:
    """Run ``script`` of this checkout and of ``rev``, alternating, ``rounds`` times each.
    ``own_config``: a config path inside the checkout that each side reads from its own tree
    (a comparison of a tuned config with the config as it was at ``rev``), in place of the
    value of ``--config`` in ``args``."""
    commit = revision(rev, repo)
    work = Path(tempfile.mkdtemp(prefix="bench_against_"))
    other = work / "tree"
    _git("worktree", "add", "--detach", str(other), commit, cwd=repo)
    results: dict[str, list[dict]] = {"this": [], "against": []}
    order = []
    try:
        for r in range(rounds):
            sides = ("this", "against") if r % 2 == 0 else ("against", "this")
            order.append(list(sides))
            for side in sides:
                tree = repo if side == "this" else other
                print(f"--against: round {r + 1}/{rounds}: {side} ({tree})", file=sys.stderr,
                      flush=True)
                logs = work / f"{side}_{r}"
                logs.mkdir()
                side_args = _with_config(args, tree / own_config) if own_config else args
                results[side].append(run(tree, script, [*side_args, "--log-dir", str(logs)],
                                         nproc, logs / "stderr.log"))
    finally:
        _git("worktree", "remove", "--force", str(other), cwd=repo)
        shutil.rmtree(work, ignore_errors=True)
    medians = {side: _medians([_numbers(r) for r in runs]) for side, runs in results.items()}
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=repo))
    return {
        "this": _git("rev-parse", "HEAD", cwd=repo) + (" + uncommitted changes" if dirty else ""),
        "against": commit, "rounds": rounds, "order": order,
        "timing/all_per_round": {side: [r.get("timing/all") for r in runs]
                                 for side, runs in results.items()},
        "ratio": {k: round(v / medians["against"][k], 4) for k, v in medians["this"].items()
                  if k.startswith("timing/") and medians["against"].get(k)},
        "this_side": medians["this"], "against_side": medians["against"],
    }


def _with_config(args: list[str], config: Path) -> list[str]:
    """``args`` with the value of ``--config`` (either spelling) replaced by ``config``."""
    out, replace_next = [], False
    for a in args:
        if replace_next:
            out.append(str(config))
            replace_next = False
        elif a == "--config":
            out.append(a)
            replace_next = True
        elif a.startswith("--config="):
            out.append(f"--config={config}")
        else:
            out.append(a)
    return out


def own_config_path(config: str, repo: Path = ROOT) -> str:
    """``config`` relative to the checkout (``--own-config``); a clear error outside it."""
    try:
        return str(Path(config).resolve().relative_to(repo))
    except ValueError:
        raise SystemExit(f"--own-config: {config} is not a file of {repo}; give the config "
                         "inside the checkout, which each side then reads from its own tree") \
            from None


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = set().union(*runs) if runs else set()
    return {k: round(statistics.median(r[k] for r in runs if k in r), 4) for k in sorted(keys)}
