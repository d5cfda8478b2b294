"""Run a launcher exactly as a user does (a subprocess under torchrun) and read back its
metrics.jsonl: shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Multi-turn GRPO on the tiny models: the real code interpreter behind the scripted parser of
# tests/scripted_tools.py (a random model writes no tool calls), which the launch imports
# from this folder (SCRIPTED_TOOLS_ENV).
MULTI_TURN = [
    "megatron_training.prompt_type=qwen_retool", "megatron_training.seq_length=1000",
    "rl_config.multi_turn_enable=true",
    f"rl_config.tool_config_path={ROOT / 'configs' / 'tools' / 'code_interpreter.yaml'}",
    "rl_config.tool_parser_format=scripted_tools:every_turn", "rl_config.max_tool_calls=2",
    "rl_config.max_total_response_length=112", "rl_config.max_tool_response_length=40",
    "rl_config.max_prompt_length=1000", "generate_config.max_model_len=1120",
    "generate_config.sampling_config.max_tokens=24",
]
SCRIPTED_TOOLS_ENV = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                    os.environ.get("PYTHONPATH", "")])}


def run_job(assets: dict, run: str, *overrides: str, launcher: str, config: Path,
            nproc: int = 2, timeout: int = 900, check: bool = True, env: dict | None = None):
    """``torchrun --nproc_per_node nproc LAUNCHER --config CONFIG`` with the tiny model, the
    data and ``assets['root']/run/logs`` as log_dir; returns (process, metrics rows)."""
    log_dir = assets["root"] / run / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           str(ROOT / launcher), "--config", str(config),
           f"megatron_training.model={assets['model']}",
           f"megatron_training.data_path={assets['data']}",
           f"megatron_training.log_dir={log_dir}", *overrides]
    proc = _run(cmd, cwd=assets["root"], timeout=timeout,
                env=dict(os.environ, PYTHONWARNINGS="ignore", **(env or {})))
    if not check:
        return proc, []
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


def _run(cmd: list[str], *, cwd, timeout: float, env: dict) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose timeout also kills the ranks torchrun started (a hung job's
    ranks would otherwise outlive the test and slow every later one)."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def training_rows(rows: list[dict]) -> dict[int, dict]:
    """The rows of training iterations (not evaluations), by iteration."""
    return {r["iteration"]: r for r in rows if "timing/all" in r}


def sample_flow_traces(assets: dict, run: str) -> list[list[dict]]:
    """[iteration][rank] -> that rank's sample-flow trace of the iteration
    (``rl_config.log_sample_flow``)."""
    folder = assets["root"] / run / "logs" / "sample_flow"
    ranks = [[json.loads(line)["rows"] for line in p.read_text().splitlines()]
             for p in sorted(folder.glob("rank*.jsonl"))]
    return [list(per_rank) for per_rank in zip(*ranks)]


def updated_rows(per_rank: list[dict]) -> list[int]:
    """Every row id the update received in the iteration, over all ranks (with repeats)."""
    return sorted(r for t in per_rank for k, v in t.items() if k.startswith("update") for r in v)


def stopped_at(save: Path, iteration: int, copy: Path) -> Path:
    """``copy``: the checkpoint folder ``save`` as a job that stopped right after saving
    ``iteration`` would have left it (the folder's files, ``iter_<iteration>`` and the
    tracker naming it). A run with ``save_interval`` then serves as both the uninterrupted
    run and the interrupted one, which saves a launch per resume test."""
    import shutil

    name = f"iter_{iteration:07d}"
    copy.mkdir(parents=True)
    for item in save.iterdir():
        if item.is_file() and item.name != "latest_checkpointed_iteration.txt":
            shutil.copy2(item, copy / item.name)
    shutil.copytree(save / name, copy / name)
    (copy / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return copy
