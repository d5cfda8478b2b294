"""Metrics: JSONL/TensorBoard/console logging, resume truncation, timers, progress, plot tool."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from mindspeed_rl.metrics import (MetricsLogger, Timers, format_console_line, rank0_progress,
                                  read_metrics)

REPO = Path(__file__).resolve().parent.parent
PLOT_TOOL = REPO / "tools" / "plot_metrics.py"


def _load_plot_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", PLOT_TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plot_metrics"] = module  # dataclasses resolve annotations via sys.modules
    spec.loader.exec_module(module)
    return module


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


# ---- JSONL -------------------------------------------------------------------------


def test_jsonl_rows_keys_and_values(tmp_path):
    import torch

    with MetricsLogger(tmp_path, rank=0) as logger:
        logger.log(1, {"reward/mean": 0.5, "actor/pg_loss": torch.tensor(-0.25),
                       "num_samples": 8, "actor/kl_loss": float("nan"),
                       "actor/grad_norm": float("inf")})
        logger.log(2, {"reward/mean": 0.75})
        # Flushed per line: readable while the logger is still open.
        assert len(_lines(tmp_path / "metrics.jsonl")) == 2

    lines = _lines(tmp_path / "metrics.jsonl")
    assert lines[0].startswith('{"iteration": 1, ')
    row = json.loads(lines[0])
    assert list(row) == ["iteration", "actor/grad_norm", "actor/kl_loss", "actor/pg_loss",
                         "num_samples", "reward/mean"]
    assert row["actor/pg_loss"] == -0.25 and row["num_samples"] == 8
    assert row["actor/kl_loss"] is None and row["actor/grad_norm"] is None  # strict JSON
    assert json.loads(lines[1]) == {"iteration": 2, "reward/mean": 0.75}

    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert list(rows) == [1, 2] and math.isnan(rows[1]["actor/kl_loss"])


def test_log_rejects_bad_input(tmp_path):
    with MetricsLogger(tmp_path, rank=0) as logger:
        with pytest.raises(TypeError, match="'note'"):
            logger.log(1, {"note": "hello"})
        with pytest.raises(ValueError, match="first argument"):
            logger.log(1, {"iteration": 3})
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(2, {"x": 1.0})
    for rank in (0, 1):
        with pytest.raises(ValueError, match="log_dir"):
            MetricsLogger(None, rank=rank, use_tensorboard=True)


def test_nonzero_rank_writes_nothing(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    with MetricsLogger(log_dir, rank=1, use_tensorboard=True, use_wandb=True) as logger:
        logger.log(1, {"reward/mean": 0.5})
        logger.truncate_after(0)
    assert not log_dir.exists()
    assert capsys.readouterr().out == ""


def test_console_only_without_log_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MetricsLogger(None, rank=0, total_iterations=5) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert capsys.readouterr().out == "iter 1/5 | reward 0.5\n"
    assert list(tmp_path.iterdir()) == []


def test_new_run_moves_old_file_aside(tmp_path):
    with MetricsLogger(tmp_path, rank=0) as logger:
        logger.log(1, {"a": 1.0})
    for a in (2.0, 3.0):
        with MetricsLogger(tmp_path, rank=0) as logger:
            logger.log(1, {"a": a})
    assert read_metrics(tmp_path / "metrics.jsonl") == {1: {"a": 3.0}}
    assert read_metrics(tmp_path / "metrics.jsonl.bak") == {1: {"a": 2.0}}


def test_resume_truncate_after_drops_rows_past_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, rank=0) as logger:
        for it in range(1, 6):
            logger.log(it, {"reward/mean": it / 10})
    # The crash tore the last line mid-write.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 6, "rew')

    # Resume from the checkpoint at iteration 3 and redo 4..5.
    with MetricsLogger(tmp_path, rank=0, resume=True) as logger:
        logger.truncate_after(3)
        assert [json.loads(x)["iteration"] for x in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        for it in (4, 5):
            logger.log(it, {"reward/mean": it})
    iterations = [json.loads(x)["iteration"] for x in _lines(tmp_path / "metrics.jsonl")]
    assert iterations == [1, 2, 3, 4, 5]
    assert read_metrics(tmp_path / "metrics.jsonl")[4] == {"reward/mean": 4.0}
    assert not (tmp_path / "metrics.jsonl.bak").exists()


def test_read_metrics_merges_rows_and_reports_errors(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 2, "a": 1}\n{"iteration": 1, "a": 0}\n'
                    '{"iteration": 2, "eval/accuracy": 0.5}\n')
    assert read_metrics(path) == {1: {"a": 0.0}, 2: {"a": 1.0, "eval/accuracy": 0.5}}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_metrics(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        read_metrics(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"iteration": 1}\nnot json\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_metrics(tmp_path / "bad.jsonl")


# ---- TensorBoard / wandb -----------------------------------------------------------


def _tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    with MetricsLogger(tmp_path, rank=0, use_tensorboard=True, run_config={"lr": 1e-6}) as logger:
        for it in (1, 2, 3):
            logger.log(it, {"reward/mean": float(it)})
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 1.0), (2, 2.0), (3, 3.0)]

    with MetricsLogger(tmp_path, rank=0, use_tensorboard=True, resume=True) as logger:
        logger.truncate_after(1)
        logger.log(2, {"reward/mean": 20.0})
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 1.0), (2, 20.0)]

    # A new run in the same log_dir starts fresh curves and keeps the old ones aside.
    with MetricsLogger(tmp_path, rank=0, use_tensorboard=True) as logger:
        logger.log(1, {"reward/mean": 5.0})
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 5.0)]
    assert _tb_scalars(tmp_path / "tensorboard.bak", "reward/mean") == [(1, 1.0), (2, 20.0)]


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, rank=0, use_wandb=True)


def test_wandb_logs_and_resumes_same_run(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def __init__(self, run_id):
            self.id = run_id

        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(kwargs["id"] or "run123")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(tmp_path, rank=0, use_wandb=True, wandb_project="p",
                       run_config={"seed": 1}) as logger:
        logger.log(1, {"reward/mean": 0.5})
    assert calls[0][1]["project"] == "p" and calls[0][1]["config"] == {"seed": 1}
    assert calls[0][1]["id"] is None
    assert calls[1:] == [("log", {"reward/mean": 0.5}, 1), ("finish",)]

    calls.clear()
    MetricsLogger(tmp_path, rank=0, use_wandb=True, resume=True).close()
    assert calls[0][1]["id"] == "run123" and calls[0][1]["resume"] == "allow"


# ---- console -----------------------------------------------------------------------


def test_console_line(tmp_path, capsys):
    metrics = {
        "reward/mean": 0.41, "response_length/mean": 37.2, "actor/pg_loss": -0.012,
        "actor/kl_loss": 0.0031, "actor/entropy": 1.23, "actor/pg_clipfrac": 0.02,
        "actor/grad_norm": 0.84, "actor/lr": 1e-6,
        "throughput/e2e_tokens_per_s_per_device": 812.4, "timing/all": 41.23,
        "timing/rollout": 22.1, "timing/update": 9.81, "timing/reward": 1.0,
        "eval/accuracy": 0.55, "response_length/max": 120.0,
    }
    with MetricsLogger(tmp_path, rank=0, total_iterations=20) as logger:
        logger.log(3, metrics)
    assert capsys.readouterr().out == (
        "iter 3/20 | reward 0.41 | len 37.2 | pg_loss -0.012 | kl 0.0031 | ent 1.23 | "
        "clipfrac 0.02 | gnorm 0.84 | lr 1.0e-06 | tok/s/dev 812 | "
        "41.2s (rollout 22.1 update 9.8) | eval accuracy 0.55\n")


def test_console_line_skips_missing_keys():
    assert format_console_line(7, {}) == "iter 7"
    assert format_console_line(7, {"timing/rollout": 2.0, "actor/kl_loss": float("nan")}, 9) == \
        "iter 7/9 | kl nan | time rollout 2.0"
    assert format_console_line(1, {"timing/all": 3.0, "response_length/mean": 12345.6}) == \
        "iter 1 | len 12346 | 3.0s"


# ---- timers / progress -------------------------------------------------------------


def test_timers_accumulate_nest_and_pop():
    syncs = []
    timers = Timers(synchronize=lambda: syncs.append(1))
    with timers.phase("all"):
        with timers.phase("rollout"):
            time.sleep(0.02)
        with timers.phase("update"):
            time.sleep(0.01)
        with timers.phase("update"):
            time.sleep(0.01)
    assert len(syncs) == 8  # start and end of each of the four phases
    timing = timers.pop()
    assert list(timing) == ["timing/rollout", "timing/update", "timing/all"]
    assert timing["timing/rollout"] >= 0.02 and timing["timing/update"] >= 0.02
    assert timing["timing/all"] >= timing["timing/rollout"] + timing["timing/update"]
    assert timers.pop() == {}

    with pytest.raises(RuntimeError):
        with timers.phase("rollout"):
            raise RuntimeError("boom")
    assert set(timers.pop()) == {"timing/rollout"}  # charged even when the phase fails
    with pytest.raises(ValueError, match="already running"):
        with timers.phase("all"):
            with timers.phase("all"):
                pass


def test_rank0_progress(capsys):
    bar = rank0_progress(total=10, desc="rollout", rank=0)
    bar.update(4)
    bar.close()
    assert "rollout" in capsys.readouterr().err
    assert list(rank0_progress(range(3), desc="iter", rank=1)) == [0, 1, 2]
    with rank0_progress(total=5, rank=0, enabled=False) as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""


# ---- plot tool ---------------------------------------------------------------------


def _synthetic_metrics(path: Path, n: int = 12) -> None:
    with MetricsLogger(path.parent, rank=0) as logger:
        for it in range(1, n + 1):
            logger.log(it, {
                "reward/mean": it / n, "response_length/mean": 30 + it,
                "response_length/max": 60 + it, "actor/pg_loss": -0.01 * it,
                "actor/kl_loss": 0.001 * it, "actor/entropy": 1.0, "actor/grad_norm": 0.5,
                "throughput/e2e_tokens_per_s_per_device": 800.0, "timing/all": 40.0,
                "timing/rollout": 22.0, "timing/update": 10.0,
            })
            if it % 4 == 0:
                logger.log(it, {"eval/accuracy": it / n})


def test_plot_metrics_writes_group_pngs(tmp_path):
    plot_tool = _load_plot_tool()
    metrics = tmp_path / "run" / "metrics.jsonl"
    _synthetic_metrics(metrics)
    paths = plot_tool.plot_metrics(metrics, tmp_path / "plots", smooth=3)
    assert [p.name for p in paths] == ["reward.png", "kl.png", "lengths.png", "throughput.png",
                                       "timings.png", "loss.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    only = plot_tool.plot_metrics(metrics, tmp_path / "keys", keys=["actor/entropy"])
    assert [p.name for p in only] == ["actor_entropy.png"]
    with pytest.raises(ValueError, match="nope"):
        plot_tool.plot_metrics(metrics, tmp_path / "keys", keys=["nope"])


def test_plot_metrics_skips_groups_without_data(tmp_path):
    plot_tool = _load_plot_tool()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1, "reward/mean": 0.1}\n')
    assert [p.name for p in plot_tool.plot_metrics(metrics, tmp_path)] == ["reward.png"]


def test_plot_metrics_draws_tool_use_of_a_multi_turn_run(tmp_path):
    plot_tool = _load_plot_tool()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 0, "eval/accuracy": 0.05, "eval/tool_call_rate": 0.06}\n'
                       '{"iteration": 1, "reward/mean": -0.8, "multi_turn/tool_call_rate": 0.2, '
                       '"multi_turn/tool_error_rate": 0.4, "multi_turn/tool_timeout_rate": 0.0}\n')
    assert [p.name for p in plot_tool.plot_metrics(metrics, tmp_path)] == ["reward.png",
                                                                            "tools.png"]


def test_plot_metrics_cli(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _synthetic_metrics(metrics, n=3)
    run = subprocess.run([sys.executable, str(PLOT_TOOL), str(metrics), "--out",
                          str(tmp_path / "plots"), "--keys", "reward/mean"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "plots" / "reward_mean.png")

    missing = subprocess.run([sys.executable, str(PLOT_TOOL), str(tmp_path / "nope.jsonl")],
                             capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
