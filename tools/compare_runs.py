#!/usr/bin/env python
"""Plot one metric of several runs in one PNG, against training wall-clock time or iteration.

  python tools/compare_runs.py GRPO=outputs/grpo_smollm2_demo/logs/metrics.jsonl \\
      DAPO=outputs/dapo_smollm2_demo/logs/metrics.jsonl --key eval/accuracy --out cmp.png

The time of iteration k is the sum of ``timing/all`` of iterations 1..k (training only: the
evaluations, start-up and shutdown are not counted); an evaluation logged at iteration k is
drawn at that time (iteration 0: time 0). Prints one JSON line per run with the metric's
first and last value and the minutes they were reached at.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[float], list[int], list[float]]:
    """(minutes, iterations, values) of ``key`` in one run's merged rows."""
    elapsed, minutes_at = 0.0, {0: 0.0}
    for it in sorted(rows):
        if "timing/all" in rows[it]:
            elapsed += rows[it]["timing/all"]
        minutes_at[it] = elapsed / 60
    points = [(minutes_at[it], it, rows[it][key]) for it in sorted(rows)
              if rows[it].get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("runs", nargs="+", metavar="NAME=METRICS.jsonl")
    p.add_argument("--key", default="eval/accuracy", help="the metric (default eval/accuracy)")
    p.add_argument("--x", choices=["minutes", "iteration"], default="minutes")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mindspeed_rl.metrics import read_metrics

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in args.runs:
        name, sep, path = run.partition("=")
        if not sep:
            print(f"error: {run!r} is not NAME=METRICS.jsonl", file=sys.stderr)
            return 2
        try:
            minutes, iterations, values = series(read_metrics(path), args.key)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not values:
            print(f"error: {path} has no {args.key}", file=sys.stderr)
            return 2
        ax.plot(minutes if args.x == "minutes" else iterations, values, marker="o", label=name)
        print(json.dumps({"run": name, "key": args.key, "first": values[0], "last": values[-1],
                          "best": max(values), "last_iteration": iterations[-1],
                          "minutes": round(minutes[-1], 2)}))
    ax.set_xlabel("training wall-clock (minutes)" if args.x == "minutes" else "iteration")
    ax.set_ylabel(args.key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
