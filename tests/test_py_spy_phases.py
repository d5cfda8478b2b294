"""tools/py_spy_phases.py: samples split by the trainer phase on their stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from py_spy_phases import split_by_phase  # noqa: E402

RAW = [
    # a rollout sample: vLLM's GEMM under an op's __call__ (skipped for the frame above)
    'process 1:"python";run_iteration (mindspeed_rl/trainer/trainer.py:150);'
    'rollout (mindspeed_rl/trainer/phases.py:60);generate (mindspeed_rl/rollout/vllm_engine.py:450);'
    'onednn_mm (vllm/_custom_ops.py:12);__call__ (torch/_ops.py:1200) 7\n',
    # an update sample whose own helper is the innermost project frame
    'process 1:"python";actor_update (mindspeed_rl/trainer/phases.py:431);'
    '_actor_metrics (mindspeed_rl/trainer/phases.py:470);'
    'nonfinite_reason (mindspeed_rl/fault/nonfinite.py:60);isfinite (torch/x.py:1) 3\n',
    # outside any phase
    'process 1:"python";main (pretrain_grpo.py:10);build (mindspeed_rl/models/builder.py:5) 2\n',
    "not a sample line\n",
]


def test_samples_go_to_the_phase_on_their_stack():
    phases = split_by_phase(RAW)
    assert {k: v["samples"] for k, v in phases.items()} == {"rollout": 7, "actor_update": 3,
                                                            "other": 2}
    assert phases["rollout"]["leaf"] == {"onednn_mm (vllm/_custom_ops.py)": 7}
    assert phases["rollout"]["ours"] == {"generate (mindspeed_rl/rollout/vllm_engine.py)": 7}
    # a private helper of phases.py is not a phase: the sample stays with actor_update
    assert phases["actor_update"]["ours"] == {
        "nonfinite_reason (mindspeed_rl/fault/nonfinite.py)": 3}


def test_the_command_prints_json_and_names_a_bad_file(tmp_path):
    raw = tmp_path / "prof.raw"
    raw.write_text("".join(RAW))
    tool = [sys.executable, str(ROOT / "tools" / "py_spy_phases.py")]
    out = subprocess.run(tool + [str(raw), "--json"], capture_output=True, text=True, check=True)
    shares = {k: v["share"] for k, v in json.loads(out.stdout).items()}
    assert shares == {"rollout": round(7 / 12, 4), "actor_update": 0.25,
                      "other": round(2 / 12, 4)}
    empty = tmp_path / "empty.raw"
    empty.write_text("nothing here\n")
    for path, why in ((empty, "no samples"), (tmp_path / "missing.raw", "No such file")):
        proc = subprocess.run(tool + [str(path)], capture_output=True, text=True)
        assert proc.returncode == 2 and str(path) in proc.stderr and why in proc.stderr
