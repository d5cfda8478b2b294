"""Partial rollout end to end on CPU (torchrun, 2 ranks, tiny model): rows carried across
iterations reach the update once, whole and within the age bound; a run stopped with
partial rows in the dock resumes exactly; DAPO's rounds run on the same pool.

The tiny random model rarely writes EOS, so these runs end responses at "stop" token ids:
seventy of them (about one token in five) for N = 2, so that most groups finish in the
first pass (12 of 24 tokens) and some stop at the pass budget and carry over unfinished;
a hundred (one in four) for DAPO; thirty (one in thirteen) for the step-wise engine, whose
responses must outlast the 16 steps between two stop checks.
"""

from __future__ import annotations

import pytest
from test_dapo_e2e import DAPO
from torchrun_jobs import (ROOT, run_job, sample_flow_traces, stopped_at, training_rows,
                          updated_rows)

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
STOPS = "generate_config.sampling_config.stop_token_ids=[" + ",".join(map(str, range(100, 200))) + "]"
SOME = "generate_config.sampling_config.stop_token_ids=[" + ",".join(map(str, range(100, 170))) + "]"
SPARSE = "generate_config.sampling_config.stop_token_ids=[" + ",".join(map(str, range(100, 130))) + "]"
SPLIT = 2  # partial_rollout_max_split: no trained row is older than SPLIT - 1 iterations
PARTIAL = [f"rl_config.partial_rollout_max_split={SPLIT}", "rl_config.log_sample_flow=true",
           SOME, "actor_config.tensor_model_parallel_size=1"]  # two DP ranks: each row once


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial_e2e")
    train, _ = make_arithmetic_problems(15, 1, seed=0, max_operand=4, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl"}


def _grpo(assets, run, *overrides):
    return run_job(assets, run, *overrides, launcher="pretrain_grpo.py", config=CONFIG)


def test_carried_rows_train_once_whole_and_young_and_resume_exactly(assets):
    full_ckpt = assets["root"] / "ckpt_full"
    _, rows = _grpo(assets, "full", *PARTIAL, "megatron_training.train_iters=4",
                    "megatron_training.save_interval=1", f"actor_config.save={full_ckpt}")
    train = training_rows(rows)
    assert sorted(train) == [1, 2, 3, 4]
    trained = []
    for it, per_rank in enumerate(sample_flow_traces(assets, "full"), start=1):
        released = per_rank[0]["partial_rollout/released_round0"]
        assert all(t["partial_rollout/released_round0"] == released for t in per_rank)
        assert len(released) == 4 * 4  # global_batch_size whole groups of n = 4
        updated = updated_rows(per_rank)
        assert updated == released, it  # exactly the released (finished) rows, once each
        trained += updated
        assert train[it]["partial_rollout/trained_age_max"] <= SPLIT - 1
    assert len(trained) == len(set(trained))  # no row id trains twice, across iterations
    # rows really carried over, some of them unfinished with tokens, and were trained
    # off-policy with truncated importance weights
    assert train[1]["partial_rollout/carried_tokens"] > 0
    assert train[1]["partial_rollout/carried_unfinished_rows"] > 0
    assert max(r["partial_rollout/trained_age_max"] for r in train.values()) >= 1
    off = [r["rollout/off_policy_token_fraction"] for r in train.values()]
    assert max(off) > 0 and min(off) < 1
    assert all(r["rollout/off_policy_is_weight_max"] <= 2.0 for r in train.values())
    # stop after 1 iteration with partial rows in the dock; the resumed run is the same
    ckpt = stopped_at(full_ckpt, 1, assets["root"] / "ckpt")
    _, resumed = _grpo(assets, "part", *PARTIAL, "megatron_training.train_iters=4",
                       f"actor_config.load={ckpt}", f"actor_config.save={ckpt}")
    resumed = training_rows(resumed)
    assert sorted(resumed) == [2, 3, 4]
    for it in (2, 3, 4):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                    "partial_rollout/carried_tokens", "partial_rollout/trained_age_mean",
                    "rollout/off_policy_token_fraction", "rollout/off_policy_is_weight_mean"):
            assert resumed[it][key] == pytest.approx(train[it][key], rel=1e-6, abs=1e-9), \
                (it, key)


def test_dapo_rounds_draw_on_the_partial_rollout_pool(assets):
    _, rows = run_job(assets, "dapo", *DAPO, "rl_config.partial_rollout_max_split=2", STOPS,
                      "megatron_training.train_iters=2", launcher="pretrain_grpo.py",
                      config=CONFIG)
    train = training_rows(rows)
    for it, per_rank in enumerate(sample_flow_traces(assets, "dapo"), start=1):
        kept = per_rank[0]["dynamic_sampling/kept"]
        updated = updated_rows(per_rank)
        assert updated == kept and len(kept) == 4 * 4
        released = {r for k, v in per_rank[0].items() if k.startswith("partial_rollout/released")
                    for r in v}
        assert set(kept) <= released  # the rounds' groups come from the pool, finished
        assert train[it]["partial_rollout/trained_age_max"] <= 1
        assert train[it]["dynamic_sampling/num_gen_batches"] >= 1


def test_step_wise_engine_stops_once_enough_groups_are_finished(assets):
    """async_engine: one pass per round decodes until the round's groups are finished on
    every rank together, then aborts the rest, which carry over with their tokens."""
    # Longer responses than the 16 steps between two stop checks: up to 64 tokens.
    # One optimizer step per iteration (mini-batch = global batch): no old_log_p forward,
    # the update's own forward is the proximal policy of the carried rows.
    _, rows = _grpo(assets, "stepwise", *PARTIAL, SPARSE, "rl_config.async_engine=true",
                    "generate_config.sampling_config.max_tokens=64",
                    "generate_config.max_model_len=128", "megatron_training.seq_length=128",
                    "megatron_training.train_iters=3", "rl_config.mini_batch_size=4")
    train = training_rows(rows)
    assert not any("timing/old_log_p" in r for r in train.values())
    off = [r["rollout/off_policy_token_fraction"] for r in train.values()]
    assert max(off) > 0  # carried rows of older weights were trained, importance-weighted
    assert all(0 < r["rollout/off_policy_is_weight_max"] <= 2.0
               for r, f in zip(train.values(), off) if f > 0)
    for it, per_rank in enumerate(sample_flow_traces(assets, "stepwise"), start=1):
        released = per_rank[0]["partial_rollout/released_round0"]
        updated = updated_rows(per_rank)
        assert updated == released and len(released) == 4 * 4
        assert train[it]["partial_rollout/passes"] <= 1  # no budget: one pass is enough
        assert train[it]["partial_rollout/trained_age_max"] <= SPLIT - 1
    # the first pass stopped with rows unfinished: they carry over with their tokens
    assert train[1]["partial_rollout/carried_unfinished_rows"] > 0
    assert train[1]["partial_rollout/carried_tokens"] > 0
