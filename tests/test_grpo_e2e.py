"""GRPO end to end on CPU: torchrun + pretrain_grpo.py, megatron + vLLM, 2 ranks, tiny model.

Runs the launcher exactly as a user does (a subprocess under torchrun) and reads
back metrics.jsonl and the checkpoints.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from torchrun_jobs import ROOT, run_job, training_rows

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
REQUIRED_KEYS = [
    "iteration", "timing/all", "timing/rollout", "timing/resharding_to_infer",
    "timing/resharding_to_train", "timing/reward", "timing/adv",
    "timing/reference_model", "timing/update", "throughput/e2e_tokens_per_s_per_device",
    "throughput/rollout_tokens_per_s_per_device", "reward/mean", "response_length/mean",
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm",
    "actor/lr", "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max",
    "response/truncated_fraction", "transfer_dock/collectives", "reward/timeouts", "reward/errors",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    train, test = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(test, root / "test.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl", "test": root / "test.jsonl"}


def launch(assets, run: str, *overrides: str, nproc: int = 2, timeout: int = 600):
    return run_job(assets, run, *overrides, launcher="pretrain_grpo.py", config=CONFIG,
                   nproc=nproc, timeout=timeout)


@pytest.mark.parametrize("layout", [
    ["actor_config.tensor_model_parallel_size=2", "generate_config.infer_tensor_parallel_size=1"],
    # one mini-batch per iteration: the on-policy path (old log-probs from the update itself)
    ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=2",
     "generate_config.infer_tensor_parallel_size=2", "rl_config.mini_batch_size=4"],
], ids=["tp2_to_tpg1", "pp2_to_tpg2"])
def test_grpo_iterations_complete_with_all_metrics(assets, layout):
    name = "run_" + layout[0][-1] + layout[-1][-1]
    # Sampled at T = 0.7: vLLM's log-probs, the old, reference and update log-probs all
    # describe softmax(logits / 0.7) (a phase at T = 1 would break the checks below).
    proc, rows = launch(assets, name, "megatron_training.train_iters=3",
                        f"megatron_training.test_data_path={assets['test']}",
                        "generate_config.sampling_config.temperature=0.7", *layout)
    train = training_rows(rows)
    assert sorted(train) == [1, 2, 3]
    for it, row in train.items():
        missing = [k for k in REQUIRED_KEYS if k not in row]
        assert not missing, (it, missing)
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert row[k] is not None and math.isfinite(row[k]), (it, k, row[k])
        assert row["actor/grad_norm"] > 0 and row["actor/entropy"] > 0
        assert row["response_length/mean"] > 0 and row["timing/all"] > 0
        assert row["reward/timeouts"] == row["reward/errors"] == 0  # rewards in worker processes
    # the reference is the initial policy: no KL before the first update, some after
    assert train[1]["actor/kl_loss"] < train[3]["actor/kl_loss"]
    if "rl_config.mini_batch_size=4" in layout:  # one step per iteration: the first sees none
        assert abs(train[1]["actor/kl_loss"]) < 1e-6
    # Two mini-batches need the old log-probs; one mini-batch (on-policy) skips that forward.
    assert ("timing/old_log_p" in train[1]) == ("rl_config.mini_batch_size=4" not in layout)
    # fp32 vLLM and megatron agree on the log-probs of the same weights.
    assert all(row["rollout/logprob_abs_diff_max"] < 1e-3 for row in train.values())
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["iteration"] for r in evals] == [0, 3]
    assert "iter 3/3" in proc.stdout + proc.stderr


def test_resume_reproduces_uninterrupted_run(assets):
    """Stop after 2 of 3 iterations, resume from the checkpoint: iteration 3 is identical."""
    full_ckpt, part_ckpt = assets["root"] / "ckpt_full", assets["root"] / "ckpt_part"
    _, full = launch(assets, "full", "megatron_training.train_iters=3",
                     "megatron_training.save_interval=1", f"actor_config.save={full_ckpt}")
    _, part = launch(assets, "part", "megatron_training.train_iters=2",
                     f"actor_config.save={part_ckpt}")
    assert (part_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not list(part_ckpt.glob("*.tmp*"))  # nothing half-written is left
    _, resumed = launch(assets, "part", "megatron_training.train_iters=3",
                        f"actor_config.load={part_ckpt}", f"actor_config.save={part_ckpt}")
    full, resumed = training_rows(full), training_rows(resumed)
    assert sorted(resumed) == [1, 2, 3]  # rows of the first run kept, no duplicates
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
                "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert resumed[3][key] == pytest.approx(full[3][key], rel=1e-6, abs=1e-9), key
    assert resumed[2]["actor/grad_norm"] == pytest.approx(full[2]["actor/grad_norm"], rel=1e-6)
    # The trained policy exports to an HF directory that transformers loads.
    hf_out = assets["root"] / "exported"
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"), "--load-model-type", "mg",
                    "--save-model-type", "hf", "--load-dir", str(part_ckpt), "--save-dir", str(hf_out),
                    "--no-progress"], check=True, capture_output=True, timeout=300)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(hf_out)).config.model_type == "qwen2"


def test_job_script_folder_starts_then_resumes_past_a_damaged_latest(assets):
    """load = save on every launch: the first starts from the model; when the latest
    checkpoint is damaged the next resumes from the one before and says so."""
    ckpt = assets["root"] / "ckpt_jobscript"
    ckpt.mkdir()
    same = (f"actor_config.load={ckpt}", f"actor_config.save={ckpt}")
    first, _ = launch(assets, "jobscript", "megatron_training.train_iters=2",
                      "megatron_training.save_interval=1", *same)
    assert f"= {ckpt} holds no checkpoint yet, so the run starts from the model" in first.stdout
    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    second, rows = launch(assets, "jobscript", "megatron_training.train_iters=3", *same)
    out = second.stdout + second.stderr
    assert (f"resume: the latest checkpoint {ckpt / 'iter_0000002'} is damaged ({shard}: "
            "truncated") in out
    assert f"resuming from {ckpt / 'iter_0000001'}, the newest one that verifies" in out
    assert sorted(training_rows(rows)) == [1, 2, 3]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_exit_duration_stops_with_a_checkpoint_and_an_evaluation(assets):
    ckpt = assets["root"] / "ckpt_budget"
    proc, rows = launch(assets, "budget", "megatron_training.train_iters=3",
                        "megatron_training.exit_duration_in_mins=0.001",
                        f"megatron_training.test_data_path={assets['test']}",
                        f"actor_config.save={ckpt}")
    assert sorted(training_rows(rows)) == [1]
    assert [r["iteration"] for r in rows if "eval/accuracy" in r] == [0, 1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "exit_duration_in_mins=0.001: stopping after iteration 1 of 3" in proc.stdout
