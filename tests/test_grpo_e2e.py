"""GRPO end to end on CPU: torchrun + pretrain_grpo.py, megatron + vLLM, 2 ranks, tiny model.

Runs the launcher exactly as a user does (a subprocess under torchrun) and reads
back metrics.jsonl and the checkpoints.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
from torchrun_jobs import ROOT, run_job, stopped_at, training_rows

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


# profiler_config as MindSpeed-RL writes it, carried by the TP 2 run: two stages of its
# second iteration, recorded on rank 0 only (tests/test_profiler.py tests the rest)
PROFILED = ["profiler_config.integrated.profile=true",
            "profiler_config.integrated.stage=[actor_generate,actor_update]",
            "profiler_config.integrated.profile_step_start=2",
            "profiler_config.integrated.profile_step_end=3",
            "profiler_config.integrated.profile_ranks=[0]",
            "profiler_config.integrated.profile_analysis=true"]
LAYOUTS = {
    "tp2_to_tpg1": ["actor_config.tensor_model_parallel_size=2",
                    "generate_config.infer_tensor_parallel_size=1", *PROFILED],
    # one mini-batch per iteration: the on-policy path (old log-probs from the update itself)
    "pp2_to_tpg2": ["actor_config.tensor_model_parallel_size=1",
                    "actor_config.pipeline_model_parallel_size=2",
                    "generate_config.infer_tensor_parallel_size=2", "rl_config.mini_batch_size=4"],
    # context parallelism (ring, zig-zag chunks) on both ranks: rollout, every forward, the
    # update, and a checkpoint whose RNG shards are cut by CP rank too
    "cp2_to_tpg1": ["actor_config.tensor_model_parallel_size=1",
                    "actor_config.context_parallel_size=2",
                    "actor_config.context_parallel_algo=megatron_cp_algo",
                    "generate_config.infer_tensor_parallel_size=1"],
}
# The run the resume test stops and resumes (it saves every iteration). TP 2 resumes are
# tested by the multi-turn and LoRA modules (grpo_tiny_test.yaml's default layout).
RESUMED_LAYOUT = "cp2_to_tpg1"
# The run that is also a job script's first launch (load = save, an empty folder).
JOB_SCRIPT_LAYOUT = "pp2_to_tpg2"


def layout_overrides(assets, layout: str) -> list[str]:
    # Sampled at T = 0.7: vLLM's log-probs, the old, reference and update log-probs all
    # describe softmax(logits / 0.7) (a phase at T = 1 would break the checks below).
    return [f"megatron_training.test_data_path={assets['test']}",
            "generate_config.sampling_config.temperature=0.7", *LAYOUTS[layout]]


def job_script_folder(assets) -> tuple[str, str]:
    """load = save, as a job script that relaunches itself sets them; empty at first."""
    ckpt = assets["root"] / "ckpt_jobscript"
    ckpt.mkdir(exist_ok=True)
    return f"actor_config.load={ckpt}", f"actor_config.save={ckpt}"


@pytest.fixture(scope="module")
def layout_run(assets):
    """3 iterations at a layout, run once per module: (process, metrics rows)."""
    done = {}

    def run(layout: str):
        if layout not in done:
            save = {RESUMED_LAYOUT: ["megatron_training.save_interval=1",
                                     f"actor_config.save={assets['root'] / 'ckpt_full'}"],
                    JOB_SCRIPT_LAYOUT: ["megatron_training.save_interval=1",
                                        *job_script_folder(assets)]}.get(layout, [])
            done[layout] = launch(assets, f"run_{layout}", "megatron_training.train_iters=3",
                                  *layout_overrides(assets, layout), *save)
        return done[layout]
    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grpo_iterations_complete_with_all_metrics(layout_run, name):
    layout = LAYOUTS[name]
    proc, rows = layout_run(name)
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


def test_profiler_config_records_the_asked_stages_of_the_asked_iteration(assets, layout_run):
    proc, _ = layout_run("tp2_to_tpg1")
    folder = assets["root"] / "run_tp2_to_tpg1" / "logs" / "profiler_data"
    assert (f"profiler: torch.profiler, phases rollout, update, iteration 2 of this launch, "
            f"ranks 0 -> {folder}") in proc.stdout
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.*")) == [
        "actor_generate/rank0_iter2.pt.trace.json", "actor_generate/rank0_iter2.txt",
        "actor_update/rank0_iter2.pt.trace.json", "actor_update/rank0_iter2.txt"]
    def names(stage):
        trace = json.loads((folder / stage / "rank0_iter2.pt.trace.json").read_text())
        return {e.get("name") for e in trace["traceEvents"]}
    update, rollout = names("actor_update"), names("actor_generate")
    # megatron's backward and the optimizer step are in the update's trace, not the rollout's
    assert "phase/update" in update and "aten::mm" in update
    assert any("Backward" in n for n in update if n) and "phase/rollout" not in update
    assert "phase/rollout" in rollout and not any("Backward" in n for n in rollout if n)


def test_resume_reproduces_uninterrupted_run(assets, layout_run):
    """Stop after 2 of 3 iterations, resume from the checkpoint: iteration 3 is identical.
    The uninterrupted run is the TP=2 layout run above, saving every iteration; the stopped
    one is its checkpoint of iteration 2 with a copy of its metrics.jsonl, whose iteration-3
    row the resumed run must replace (it follows the checkpoint)."""
    _, full = layout_run(RESUMED_LAYOUT)
    full_ckpt, part_ckpt = assets["root"] / "ckpt_full", assets["root"] / "ckpt_part"
    assert (full_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not list(full_ckpt.rglob("*.tmp*"))  # nothing half-written is left
    stopped_at(full_ckpt, 2, part_ckpt)
    shutil.copytree(assets["root"] / f"run_{RESUMED_LAYOUT}" / "logs",
                    assets["root"] / "part" / "logs")
    _, resumed = launch(assets, "part", "megatron_training.train_iters=3",
                        *layout_overrides(assets, RESUMED_LAYOUT),
                        f"actor_config.load={part_ckpt}", f"actor_config.save={part_ckpt}")
    # the stopped run's rows kept, the one past the checkpoint replaced: no duplicates
    assert [r["iteration"] for r in resumed if "timing/all" in r] == [1, 2, 3]
    full, resumed = training_rows(full), training_rows(resumed)
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
                "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert resumed[3][key] == pytest.approx(full[3][key], rel=1e-6, abs=1e-9), key
    # The trained policy exports to an HF directory that transformers loads.
    hf_out = assets["root"] / "exported"
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"), "--load-model-type", "mg",
                    "--save-model-type", "hf", "--load-dir", str(part_ckpt), "--save-dir", str(hf_out),
                    "--no-progress"], check=True, capture_output=True, timeout=300)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(hf_out)).config.model_type == "qwen2"


def test_job_script_folder_starts_then_resumes_past_a_damaged_latest(assets, layout_run):
    """load = save on every launch: the first (the PP=2 layout run) starts from the model;
    when the latest checkpoint is damaged the next resumes from the one before and says so,
    keeping the rows before it in metrics.jsonl and replacing those after it."""
    ckpt = assets["root"] / "ckpt_jobscript"
    first, _ = layout_run(JOB_SCRIPT_LAYOUT)
    assert f"= {ckpt} holds no checkpoint yet, so the run starts from the model" in first.stdout
    shard = sorted((ckpt / "iter_0000003").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    second, rows = launch(assets, f"run_{JOB_SCRIPT_LAYOUT}", "megatron_training.train_iters=4",
                          *layout_overrides(assets, JOB_SCRIPT_LAYOUT), *job_script_folder(assets))
    out = second.stdout + second.stderr
    assert (f"resume: the latest checkpoint {ckpt / 'iter_0000003'} is damaged ({shard}: "
            "truncated") in out
    assert f"resuming from {ckpt / 'iter_0000002'}, the newest one that verifies" in out
    assert sorted(training_rows(rows)) == [1, 2, 3, 4]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


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
