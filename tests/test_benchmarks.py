"""The benchmark scripts run and print their JSON (numbers are never asserted: they are
measurements); what they replay is checked against the trainer's own declarations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_rl.trainer.recipes import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_bench_transfer_dock_replays_the_declared_flow(algorithm):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "bench_transfer_dock.py"), "--algorithm", algorithm,
           "--rows", "32", "--n-samples-per-prompt", "4", "--mean-len", "16", "--max-len", "64",
           "--tp", "1", "--iterations", "2", "--reward-model"]
    for mode in ("distributed", "centralized"):
        proc = subprocess.run(cmd + ["--mode", mode], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        expected = [p for p in ALGORITHMS[algorithm] if not p.startswith("resharding")]
        assert result["phases"] == expected and result["mode"] == mode
        assert result["row_bytes_rank0_own_share"] > 0 and result["seconds_per_iteration"] > 0
