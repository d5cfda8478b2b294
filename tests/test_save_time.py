"""The estimate of a preemption's checkpoint save against rl_config.save_on_sigterm_grace_s."""

from __future__ import annotations

from pathlib import Path

from mindspeed_rl.config.cli import main as config_main
from mindspeed_rl.fault.save_time import (checkpoint_bytes_per_rank, measure_speeds,
                                          save_estimate)

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_qwen25_7b.yaml"


def test_estimate_warns_past_the_grace_window_and_names_the_fixes():
    gib = 2**30
    seconds, line = save_estimate(30 * gib, write_bps=gib, hash_bps=2 * gib, grace_s=30)
    assert seconds == 45 and line.startswith("warning: checkpoint save on SIGTERM: about 45 s")
    assert "--shutdown-timeout 68" in line and "save_on_sigterm_grace_s" in line
    seconds, line = save_estimate(gib, write_bps=gib, hash_bps=gib, grace_s=30)
    assert seconds == 2 and not line.startswith("warning")


def test_bytes_come_from_the_memory_plan_and_speeds_are_measured(tmp_path):
    assert checkpoint_bytes_per_rank({"actor_params": 2, "actor_optimizer": 12, "critic": 5,
                                      "vllm_weights": 100}) == 19
    # LoRA with lora_ckpt_filter: of the weights only the adapters' share is written
    params = {"training_per_rank": 90, "adapter_per_rank": 10}
    memory = {"actor_params": 400, "actor_optimizer": 12}
    assert checkpoint_bytes_per_rank(memory, params, adapters_only=True) == 40 + 12
    assert checkpoint_bytes_per_rank(memory, params, adapters_only=False) == 400 + 12
    write_bps, hash_bps = measure_speeds(tmp_path / "not" / "yet", nbytes=4 << 20)
    assert write_bps > 0 and hash_bps > 0 and list(tmp_path.iterdir()) == []


def test_dry_run_states_the_save_time(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(CONFIG.parents[1])  # the config's relative paths
    args = ["--config", "configs/grpo_qwen25_7b.yaml", f"actor_config.save={tmp_path}",
            "--dry-run", "--world-size", "16"]
    assert config_main(args, prog="t", algorithm="grpo") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert " GiB per rank at " in line and "save_on_sigterm_grace_s=30" in line
    assert config_main(args + ["rl_config.save_on_sigterm_grace_s=1e-9"], prog="t",
                       algorithm="grpo") == 0
    assert "warning: checkpoint save on SIGTERM" in capsys.readouterr().out

