#!/usr/bin/env python
"""Plot the curves of a run's metrics.jsonl (written by MetricsLogger) to PNG files.

Default: one PNG per group, skipping groups with no data —
  reward.png      reward/mean and eval accuracy/reward
  kl.png          actor/kl_loss (and other actor/kl* keys)
  lengths.png     response_length/mean, /max, /min
  throughput.png  throughput/* (one panel per key)
  timings.png     timing/* (one line per phase; timing/all dashed)
  loss.png        actor/pg_loss, actor/entropy, actor/grad_norm (one panel per key)
  critic.png      critic/vf_loss, critic/explained_variance, critic/vpred_mean (PPO)
  preference.png  DPO: actor/loss, rewards/accuracies, /margins, /chosen, /rejected, logps/*
  tools.png       tool-call, tool-error and tool-timeout rates (multi-turn), training and eval
With --keys, one PNG per listed key instead (named after the key, '/' -> '_').
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

EPILOG = """\
example:
  python tools/plot_metrics.py logs/metrics.jsonl --out logs/plots --smooth 5
  python tools/plot_metrics.py logs/metrics.jsonl --keys actor/pg_clipfrac,actor/lr
"""


@dataclass(frozen=True)
class _Group:
    name: str
    title: str
    select: Callable[[list[str]], list[str]]  # all keys in the file -> keys of this group
    shared_axes: bool  # one panel for all keys (same scale) or one panel per key


def _present(*wanted: str) -> Callable[[list[str]], list[str]]:
    return lambda keys: [k for k in wanted if k in keys]


def _reward_keys(keys: list[str]) -> list[str]:
    evals = [k for k in keys if k.startswith("eval/") and ("accuracy" in k or "reward" in k)]
    return _present("reward/mean")(keys) + evals


def _kl_keys(keys: list[str]) -> list[str]:
    return _present("actor/kl_loss")(keys) + [
        k for k in keys if k.startswith("actor/kl") and k != "actor/kl_loss"]


def _timing_keys(keys: list[str]) -> list[str]:
    # timing/all last so that it is drawn over the phases it contains.
    return [k for k in keys if k.startswith("timing/") and k != "timing/all"] + \
        _present("timing/all")(keys)


_GROUPS = (
    _Group("reward", "reward", _reward_keys, shared_axes=True),
    _Group("kl", "KL", _kl_keys, shared_axes=True),
    _Group("lengths", "response length (tokens)",
           _present("response_length/mean", "response_length/max", "response_length/min"),
           shared_axes=True),
    _Group("throughput", "throughput",
           lambda keys: [k for k in keys if k.startswith("throughput/")], shared_axes=False),
    _Group("timings", "phase wall time (s); nested phases overlap", _timing_keys, shared_axes=True),
    _Group("loss", "actor", _present("actor/pg_loss", "actor/entropy", "actor/grad_norm"),
           shared_axes=False),
    _Group("mismatch", "rollout vs training engine (rollout_corr/) and staleness",
           _present("rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/chi2_token",
                    "rollout_corr/ess_token", "rollout_corr/ess_seq",
                    "rollout_corr/rs_masked_fraction", "staleness/version_lag_token_mean",
                    "staleness/version_lag_max"), shared_axes=False),
    _Group("critic", "critic (PPO)", _present("critic/vf_loss", "critic/explained_variance",
                                              "critic/vpred_mean"), shared_axes=False),
    _Group("preference", "DPO (implicit rewards beta * (policy - reference))",
           _present("actor/loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
                    "rewards/rejected", "logps/chosen", "logps/rejected"), shared_axes=False),
    _Group("tools", "tool use (fraction of trajectories / of calls)",
           _present("multi_turn/tool_call_rate", "eval/tool_call_rate",
                    "multi_turn/tool_error_rate", "multi_turn/tool_timeout_rate"),
           shared_axes=True),
)


def _moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (NaN points stay NaN)."""
    out = []
    for i, value in enumerate(values):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent and not math.isnan(value) else math.nan)
    return out


def _series(rows: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    iterations = [it for it, values in rows.items() if key in values]
    return iterations, [rows[it][key] for it in iterations]


def _draw(ax, rows: dict[int, dict[str, float]], key: str, smooth: int, color=None) -> None:
    iterations, values = _series(rows, key)
    style = {"linestyle": "--", "color": "black"} if key == "timing/all" else {"color": color}
    # A single point draws no line: mark every point when there are few.
    marker = "o" if len(iterations) <= 20 else None
    # Evaluations are sparse and already averaged over a test set: never smoothed.
    if smooth > 1 and not key.startswith("eval/"):
        line, = ax.plot(iterations, values, alpha=0.3, linewidth=1, **style)
        ax.plot(iterations, _moving_average(values, smooth), label=f"{key} (avg {smooth})",
                color=line.get_color(), linestyle=line.get_linestyle())
    else:
        ax.plot(iterations, values, label=key, marker=marker, markersize=3, **style)


def _write_figure(path: Path, title: str, rows: dict[int, dict[str, float]], keys: list[str],
                  shared_axes: bool, smooth: int) -> Path:
    import matplotlib.pyplot as plt

    panels = 1 if shared_axes else len(keys)
    fig, axes = plt.subplots(panels, 1, figsize=(10, 3.2 * panels), sharex=True, squeeze=False)
    for i, key in enumerate(keys):
        ax = axes[0 if shared_axes else i][0]
        _draw(ax, rows, key, smooth, color=f"C{i}")
        ax.grid(True, alpha=0.3)
        # Outside the axes: inside, it hides the curves it names.
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0][0].set_title(title)
    axes[-1][0].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_metrics(jsonl_path: str | Path, out_dir: str | Path | None = None, *,
                 keys: list[str] | None = None, smooth: int = 1) -> list[Path]:
    """Write the PNG curves of a metrics.jsonl and return their paths.

    Args:
        jsonl_path: the metrics.jsonl written by MetricsLogger.
        out_dir: where the PNGs go (created); default: next to the JSONL file.
        keys: plot these keys, one PNG each, instead of the default groups.
        smooth: draw a trailing moving average over this many logged points on top
            of the raw curve (1: raw only); eval/* curves are never smoothed.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty or malformed, or a requested key is absent.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training nodes
    from mindspeed_rl.metrics import read_metrics

    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    rows = read_metrics(jsonl_path)
    out = Path(out_dir) if out_dir is not None else Path(jsonl_path).parent
    out.mkdir(parents=True, exist_ok=True)
    all_keys = sorted({k for values in rows.values() for k in values})

    if keys:
        missing = [k for k in keys if k not in all_keys]
        if missing:
            raise ValueError(f"keys {missing} are not in {jsonl_path}; available: {all_keys}")
        return [_write_figure(out / f"{key.replace('/', '_')}.png", key, rows, [key],
                              shared_axes=True, smooth=smooth) for key in keys]

    written = []
    for group in _GROUPS:
        group_keys = group.select(all_keys)
        if group_keys:
            written.append(_write_figure(out / f"{group.name}.png", group.title, rows, group_keys,
                                         group.shared_axes, smooth))
    return written


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="metrics.jsonl written by a training run")
    p.add_argument("--out", default=None, help="output directory (default: next to the file)")
    p.add_argument("--keys", default=None,
                   help="comma-separated keys to plot, one PNG each, "
                        "e.g. actor/lr,actor/pg_clipfrac")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="also draw a trailing moving average over N points (default 1: off); "
                        "eval/* curves are not smoothed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Runnable as `python tools/plot_metrics.py` from a checkout without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    try:
        paths = plot_metrics(args.metrics, args.out, keys=keys, smooth=args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not paths:
        print(f"error: {args.metrics} has none of the plotted keys; use --keys", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
