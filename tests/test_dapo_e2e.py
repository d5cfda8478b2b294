"""DAPO on CPU: dynamic sampling through the TransferDock under torchrun (2 ranks, tiny model).

The tiny random model writes random text; with single-digit gold answers its final integer is
sometimes right, so some groups of 4 samples have a reward spread and most do not: an
iteration needs several generation rounds to collect its informative groups.
"""

from __future__ import annotations

import json

import pytest

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

from torchrun_jobs import ROOT, run_job, stopped_at, training_rows

pytestmark = pytest.mark.slow

DAPO = ["rl_config.filter_groups_enable=true", "rl_config.verifier_function=[integer_answer]",
        "rl_config.verifier_weight=[1.0]", "rl_config.n_samples_per_prompt=4",
        "rl_config.mini_batch_size=2", "megatron_training.global_batch_size=4",
        "rl_config.overlong_buffer_len=8", "rl_config.overlong_penalty_factor=0.0",
        "rl_config.log_sample_flow=true", "actor_config.tensor_model_parallel_size=1"]
CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo")
    train, _ = make_arithmetic_problems(15, 1, seed=0, max_operand=4, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl"}


def _grpo(assets, run, *overrides, check=True, env=None):
    return run_job(assets, run, *DAPO, *overrides, launcher="pretrain_grpo.py", config=CONFIG,
                   check=check, env=env)


@pytest.fixture(scope="module")
def full_run(assets):
    """Three DAPO iterations saving from iteration 2 (fp32, healthy weight sync): the
    uninterrupted run of the resume test and the healthy run of the log-prob test."""
    full_ckpt = assets["root"] / "ckpt_full"
    _, rows = _grpo(assets, "full", "megatron_training.train_iters=3",
                    "megatron_training.save_interval=2", f"actor_config.save={full_ckpt}")
    return full_ckpt, training_rows(rows)


@pytest.fixture(scope="module")
def fill_run_on_stale_weights(assets):
    """One iteration, a single round short of informative groups and filled
    (filter_groups_shortfall=fill), with one layer's MLP left out of the weight push: the
    fill run of the shortfall test and the broken run of the log-prob test (one launch)."""
    proc, rows = _grpo(assets, "fill", "megatron_training.train_iters=1",
                       "rl_config.max_num_gen_batches=1", "megatron_training.global_batch_size=8",
                       "rl_config.mini_batch_size=4", "rl_config.filter_groups_shortfall=fill",
                       env={"MINDSPEED_RL_INJECT_STALE_WEIGHTS": r"layers\.1\.mlp\."})
    return proc, training_rows(rows)


def _traces(assets, run) -> dict[int, list[dict]]:
    folder = assets["root"] / run / "logs" / "sample_flow"
    return {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted(folder.glob("rank*.jsonl"))}


def test_dynamic_sampling_collects_exactly_the_batch_and_resumes(assets, full_run):
    full_ckpt, train = full_run
    assert sorted(train) == [1, 2, 3]
    rounds = [train[i]["dynamic_sampling/num_gen_batches"] for i in (1, 2, 3)]
    assert max(rounds) >= 2, rounds  # at least one iteration needed more prompts
    for it, row in train.items():
        assert 0 < row["dynamic_sampling/kept_group_fraction"] <= 1
        assert row["dynamic_sampling/kept_group_fraction"] * row[
            "dynamic_sampling/num_gen_batches"] * 4 >= 4 - 1e-9  # 4 groups kept of 4 x rounds
    traces = _traces(assets, "full")
    for i in range(3):  # iteration i + 1
        per_rank = [traces[r][i]["rows"] for r in sorted(traces)]
        kept = per_rank[0]["dynamic_sampling/kept"]
        assert all(t["dynamic_sampling/kept"] == kept for t in per_rank)
        assert len(kept) == 4 * 4  # global_batch_size groups x n samples
        # every kept row reaches the update exactly once (two DP ranks, two mini-batches)
        updated = sorted(r for t in per_rank for k, v in t.items() if k.startswith("update")
                         for r in v)
        assert updated == kept
        # the rows the filter saw include the dropped ones
        seen = sorted(r for t in per_rank for r in t["dynamic_sampling"])
        assert set(kept) <= set(seen) and len(seen) == 16 * rounds[i]
    # resume after 2 iterations: iteration 3 (its rounds included) is the same
    ckpt = stopped_at(full_ckpt, 2, assets["root"] / "ckpt")
    _, resumed = _grpo(assets, "part", "megatron_training.train_iters=3",
                       f"actor_config.load={ckpt}", f"actor_config.save={ckpt}")
    resumed = training_rows(resumed)
    assert sorted(resumed) == [3]
    for key in ("dynamic_sampling/num_gen_batches", "dynamic_sampling/kept_group_fraction",
                "reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert resumed[3][key] == pytest.approx(train[3][key], rel=1e-6, abs=1e-9), key


def test_too_few_informative_groups_stop_or_fill(assets, fill_run_on_stale_weights):
    proc, _ = _grpo(assets, "short", "megatron_training.train_iters=1",
                    "rl_config.max_num_gen_batches=1", "megatron_training.global_batch_size=8",
                    "rl_config.mini_batch_size=4", check=False)
    assert proc.returncode != 0
    assert "dynamic sampling:" in proc.stderr and "informative groups after " \
           "max_num_gen_batches=1 rounds" in proc.stderr
    proc, train = fill_run_on_stale_weights
    assert "continuing with" in proc.stdout and "uninformative groups" in proc.stdout
    row = train[1]
    assert row["dynamic_sampling/num_gen_batches"] == 1


def test_logprob_mismatch_shows_a_broken_weight_sync(full_run, fill_run_on_stale_weights):
    """Healthy fp32: vLLM's log-probs equal megatron's within 1e-3. With one layer's MLP left
    out of the weight push (vLLM keeps its placeholder weights there) the metric jumps.
    (The healthy run is the dynamic-sampling run, the broken one the shortfall-fill run.)"""
    healthy, broken = full_run[1], fill_run_on_stale_weights[1]
    assert healthy[1]["rollout/logprob_abs_diff_max"] < 1e-3
    assert broken[1]["rollout/logprob_abs_diff_max"] > 0.1
    assert broken[1]["rollout/logprob_abs_diff_mean"] > \
        10 * healthy[1]["rollout/logprob_abs_diff_mean"]
    # the rollout-correction diagnostics see it too (KL k3, chi2, ESS of the token weights)
    assert healthy[1]["rollout_corr/kl_k3"] < 1e-6 and healthy[1]["rollout_corr/ess_token"] > 0.9999
    assert broken[1]["rollout_corr/kl_k3"] > 1e3 * max(healthy[1]["rollout_corr/kl_k3"], 1e-12)
    assert broken[1]["rollout_corr/chi2_token"] > 1e-3
    # two optimizer steps per iteration (mini_batch_size = global_batch_size / 2): the second
    # trains rows one weight version old
    for row in (healthy[1], broken[1]):
        assert row["staleness/version_lag_max"] == 1
        assert 0 < row["staleness/version_lag_token_mean"] < 1
