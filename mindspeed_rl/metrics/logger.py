"""MetricsLogger: one row of scalars per iteration to JSONL, TensorBoard, wandb and the console.

File layout under ``log_dir`` (rank 0 only):

- ``metrics.jsonl``: one JSON object per line, ``{"iteration": k, "<key>": value, ...}``
  with ``iteration`` first and the other keys sorted. Values are JSON numbers;
  NaN and +-inf are written as ``null`` so that every line is strict JSON (any
  JSON reader, ``jq``, pandas) and a diverged value is visible rather than
  dropped. Every line is flushed, so a crash keeps all rows written before it.
  Several ``log`` calls for one iteration (e.g. training then eval) write several
  rows; readers merge rows by iteration (:func:`read_metrics`).
- ``tensorboard/``: TensorBoard event files when ``use_tensorboard`` is on.
- ``wandb/`` and ``wandb_run_id``: wandb's files and the run id reused on resume.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping

from tqdm import tqdm

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
WANDB_RUN_ID_FILENAME = "wandb_run_id"

# Console line: (metric key, label, format). The order is the order on screen.
_CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "g3"),
    ("response_length/mean", "len", "g3"),
    ("actor/pg_loss", "pg_loss", "g3"),
    ("actor/kl_loss", "kl", "g3"),
    ("actor/entropy", "ent", "g3"),
    ("actor/pg_clipfrac", "clipfrac", "g3"),
    ("actor/grad_norm", "gnorm", "g3"),
    ("actor/lr", "lr", "e1"),
    ("rollout_corr/kl_k3", "mismatch_kl", "g3"),  # rollout vs training engine (k3)
    ("rollout_corr/ess_token", "ess", "g3"),
    ("staleness/version_lag_max", "lag", "g3"),
    ("throughput/e2e_tokens_per_s_per_device", "tok/s/dev", "f0"),
)
# Phases shown in brackets after the total time (``timing/all``).
_CONSOLE_PHASES: tuple[tuple[str, str], ...] = (
    ("timing/rollout", "rollout"),
    ("timing/update", "update"),
)
_EVAL_PREFIX = "eval/"


def _format_number(value: float, style: str) -> str:
    if not math.isfinite(value):
        return str(value)  # nan / inf / -inf
    if style == "e1":
        return f"{value:.1e}"
    if style == "f0":
        return f"{value:.0f}"
    if style == "f1":
        return f"{value:.1f}"
    # Three significant digits, without switching to exponent notation for large
    # values (lengths, token counts) where the integer part is what matters.
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def format_console_line(iteration: int, metrics: Mapping[str, float],
                        total_iterations: int | None = None) -> str:
    """The one-line console summary of an iteration's metrics.

    e.g. ``iter 3/20 | reward 0.41 | len 37.2 | pg_loss -0.012 | kl 0.0031 | ent 1.23 |
    clipfrac 0.02 | gnorm 0.84 | lr 1.0e-06 | tok/s/dev 812 | 41.2s (rollout 22.1 update 9.8) |
    eval accuracy 0.55``. Keys that are absent are skipped.
    """
    parts = [f"iter {iteration}/{total_iterations}" if total_iterations else f"iter {iteration}"]
    for key, label, style in _CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {_format_number(float(metrics[key]), style)}")

    phases = " ".join(f"{label} {_format_number(float(metrics[key]), 'f1')}"
                      for key, label in _CONSOLE_PHASES if key in metrics)
    if "timing/all" in metrics:
        total = f"{_format_number(float(metrics['timing/all']), 'f1')}s"
        parts.append(f"{total} ({phases})" if phases else total)
    elif phases:
        parts.append(f"time {phases}")

    eval_keys = sorted(k for k in metrics if k.startswith(_EVAL_PREFIX))
    if eval_keys:
        parts.append("eval " + " ".join(
            f"{k[len(_EVAL_PREFIX):]} {_format_number(float(metrics[k]), 'g3')}"
            for k in eval_keys))
    return " | ".join(parts)


def _json_value(key: str, value: Any) -> int | float | None:
    """A metric value as a JSON number (tensors and numpy scalars included); non-finite -> None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number (or a one-element tensor), "
                        f"got {type(value).__name__}: {value!r}") from None
    return number if math.isfinite(number) else None


def _parse_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (crash mid-write) is ignored."""
    lines = path.read_text().splitlines()
    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if line_no == len(lines):
                break
            raise ValueError(f"{path}:{line_no}: not a JSON line ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
            raise ValueError(f"{path}:{line_no}: expected an object with an integer "
                             f"'iteration', got {line[:80]!r}")
        rows.append(row)
    return rows


def read_metrics(path: str | os.PathLike) -> dict[int, dict[str, float]]:
    """Read a metrics.jsonl into ``{iteration: {key: value}}``, sorted by iteration.

    Rows of the same iteration are merged (a later row wins for a repeated key);
    ``null`` values come back as NaN.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file has no rows, or a line that is not a metrics row.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path} does not exist (MetricsLogger writes "
                                f"<log_dir>/{METRICS_FILENAME} on rank 0)")
    merged: dict[int, dict[str, float]] = {}
    for row in _parse_rows(path):
        iteration = row.pop("iteration")
        values = merged.setdefault(iteration, {})
        for key, value in row.items():
            values[key] = math.nan if value is None else float(value)
    if not merged:
        raise ValueError(f"metrics file {path} has no rows")
    return dict(sorted(merged.items()))


def _move_aside(path: Path) -> None:
    """Rename a non-empty file or directory to ``<name>.bak`` (replacing an older backup)."""
    if not path.exists() or (path.is_file() and not path.stat().st_size) or \
            (path.is_dir() and not any(path.iterdir())):
        return
    backup = path.with_name(path.name + ".bak")
    if backup.is_dir():
        shutil.rmtree(backup)
    elif backup.exists():
        backup.unlink()
    os.replace(path, backup)
    print(f"[metrics] moved the previous {path} to {backup}", file=sys.stderr)


class MetricsLogger:
    """Logs one dict of scalars per iteration; only rank 0 writes, other ranks no-op.

    Every ``log`` appends a line to ``<log_dir>/metrics.jsonl`` (the format is
    described in this module's docstring), writes TensorBoard scalars under
    ``<log_dir>/tensorboard`` and/or wandb when enabled, and prints one compact
    console line (:func:`format_console_line`).

    Args:
        log_dir: directory for metrics.jsonl and the TensorBoard events; None logs
            to the console (and wandb) only.
        rank: this process's global rank.
        total_iterations: shown as ``iter k/total`` on the console.
        use_tensorboard: also write TensorBoard events (needs ``log_dir``).
        use_wandb: also log to Weights & Biases (needs the ``wandb`` package).
        wandb_project: the wandb project name.
        run_config: the run's configuration, stored with the wandb run and as
            TensorBoard text.
        resume: the run continues from a checkpoint: keep the existing
            metrics.jsonl and the wandb run, then call :meth:`truncate_after` with
            the checkpoint's iteration. Without it an existing metrics.jsonl and
            tensorboard/ are moved to ``metrics.jsonl.bak`` and ``tensorboard.bak``
            (replacing older backups) and new ones are started.
    """

    def __init__(self, log_dir: str | os.PathLike | None, *, rank: int,
                 total_iterations: int | None = None, use_tensorboard: bool = False,
                 use_wandb: bool = False, wandb_project: str | None = None,
                 run_config: dict | None = None, resume: bool = False):
        self.rank = rank
        self.total_iterations = total_iterations
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.metrics_path = self.log_dir / METRICS_FILENAME if self.log_dir is not None else None
        self._use_tensorboard = use_tensorboard
        self._run_config = run_config
        self._file = None
        self._tb_writer = None
        self._wandb_run = None
        self._closed = False
        # Checked on every rank so that a bad config fails everywhere, not only on rank 0.
        if use_tensorboard and self.log_dir is None:
            raise ValueError("use_tensorboard: true needs a log_dir (megatron_training.log_dir) "
                             "to write the event files to")
        if rank != 0:
            return
        if self.log_dir is not None:
            self._file = self._open_metrics_file(resume)
        if use_tensorboard:
            self._open_tensorboard(purge_step=None)
        if use_wandb:
            self._wandb_run = self._init_wandb(wandb_project, run_config, resume)

    # ---- backends ---------------------------------------------------------------

    def _open_metrics_file(self, resume: bool):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            # A new run must not append to an old run's curves, but an
            # accidental reuse of log_dir should not destroy them either.
            _move_aside(self.metrics_path)
            _move_aside(self.log_dir / TENSORBOARD_DIRNAME)
        return open(self.metrics_path, "a" if resume else "w", encoding="utf-8")

    def _open_tensorboard(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb_writer = SummaryWriter(str(self.log_dir / TENSORBOARD_DIRNAME),
                                        purge_step=purge_step)
        if self._run_config is not None and purge_step is None:
            self._tb_writer.add_text(
                "run_config", "```\n" + json.dumps(self._run_config, indent=2, default=str)
                + "\n```")

    def _init_wandb(self, project: str | None, run_config: dict | None, resume: bool):
        try:
            import wandb
        except ImportError:
            raise ImportError("use_wandb: true needs `pip install wandb`") from None
        run_id = None
        id_path = self.log_dir / WANDB_RUN_ID_FILENAME if self.log_dir is not None else None
        # The id file lets a resumed run continue the same wandb run and curves.
        if resume and id_path is not None and id_path.is_file():
            run_id = id_path.read_text().strip() or None
        run = wandb.init(project=project, config=run_config, id=run_id,
                         resume="allow" if run_id else None,
                         dir=str(self.log_dir) if self.log_dir is not None else None)
        if id_path is not None:
            id_path.write_text(run.id)
        return run

    # ---- public API ---------------------------------------------------------------

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (key -> scalar) for ``iteration`` everywhere enabled.

        Values may be Python numbers, numpy scalars or one-element tensors. NaN
        and inf are written to metrics.jsonl as ``null`` and passed unchanged to
        TensorBoard and wandb. No-op on ranks other than 0.
        """
        if self.rank != 0:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if "iteration" in metrics:
            raise ValueError("pass the iteration as the first argument of log(), "
                             "not as the metric key 'iteration'")
        values = {key: _json_value(key, metrics[key]) for key in sorted(metrics)}

        if self._file is not None:
            self._file.write(json.dumps({"iteration": iteration, **values}) + "\n")
            self._file.flush()
        floats = {key: float(metrics[key]) if v is None else float(v) for key, v in values.items()}
        if self._tb_writer is not None:
            for key, value in floats.items():
                self._tb_writer.add_scalar(key, value, global_step=iteration)
            self._tb_writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(floats, step=iteration)
        # tqdm.write keeps an active progress bar intact below the line.
        tqdm.write(format_console_line(iteration, floats, self.total_iterations), file=sys.stdout)

    def truncate_after(self, iteration: int) -> None:
        """Drop the rows with iteration > ``iteration`` (call after resuming from it).

        A run that crashed after its last checkpoint at iteration k has already
        logged k+1, k+2, ...; the resumed run logs them again, so they are removed
        from metrics.jsonl (rewritten atomically) and TensorBoard purges its
        events past k. wandb keeps its history (it rejects rewriting steps).
        """
        if self.rank != 0 or self._closed:
            return
        if self._file is not None:
            self._file.close()
            rows = [row for row in _parse_rows(self.metrics_path) if row["iteration"] <= iteration]
            tmp_path = self.metrics_path.with_name(METRICS_FILENAME + ".tmp")
            with open(tmp_path, "w", encoding="utf-8") as tmp:
                tmp.writelines(json.dumps(row) + "\n" for row in rows)
            os.replace(tmp_path, self.metrics_path)
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        if self._use_tensorboard:
            if self._tb_writer is not None:
                self._tb_writer.close()
            self._open_tensorboard(purge_step=iteration + 1)

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb_writer is not None:
            self._tb_writer.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
