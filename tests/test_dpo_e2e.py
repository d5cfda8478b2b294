"""DPO end to end on CPU: torchrun + pretrain_dpo.py (megatron actor + frozen reference, no
rollout), 2 ranks, tiny model, preference pairs from a jsonl file.

Four launches: DP 2 with evaluation (vLLM built for the greedy test accuracy only) and a
checkpoint every iteration; TP 2; PP 2; and a resume of the first from its iteration-1
checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
from torchrun_jobs import ROOT, run_job, stopped_at, training_rows

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "dpo_tiny_test.yaml"
KEYS = ["actor/loss", "actor/grad_norm", "actor/lr", "rewards/chosen", "rewards/rejected",
        "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
        "timing/pairs", "timing/reference_model", "timing/preference_update",
        "throughput/e2e_tokens_per_s_per_device"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    train, test = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    with open(root / "pairs.jsonl", "w") as f:  # a right and a wrong answer per prompt
        for i, row in enumerate(train):
            answer = int(row["answer"])
            f.write(json.dumps({"prompt": row["prompt"], "chosen": f"The answer is {answer}.",
                                "rejected": f"I think it is {answer + 1 + i % 3}."}) + "\n")
    write_jsonl(test, root / "test.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "pairs.jsonl", "test": root / "test.jsonl"}


def launch(assets, run: str, *overrides: str):
    return run_job(assets, run, *overrides, launcher="pretrain_dpo.py", config=CONFIG,
                   timeout=600)


@pytest.fixture(scope="module")
def runs(assets):
    ckpt = assets["root"] / "ckpt"
    base = launch(assets, "dp2", f"megatron_training.test_data_path={assets['test']}",
                  "megatron_training.save_interval=1", f"actor_config.save={ckpt}",
                  "generate_config.max_model_len=96",
                  "generate_config.sampling_config.max_tokens=16")
    resumed_from = stopped_at(ckpt, 1, assets["root"] / "ckpt_at_1")
    out = {"dp2": base,
           "tp2": launch(assets, "tp2", "actor_config.tensor_model_parallel_size=2",
                         "megatron_training.sequence_parallel=true"),
           "pp2": launch(assets, "pp2", "actor_config.pipeline_model_parallel_size=2",
                         "rl_config.use_remove_padding=true"),
           "resumed": launch(assets, "resumed", f"actor_config.load={resumed_from}",
                             f"actor_config.save={resumed_from}")}
    return {name: (proc, training_rows(rows), rows) for name, (proc, rows) in out.items()}


def test_dpo_trains_against_the_initial_reference_and_logs_trls_metrics(runs):
    proc, train, rows = runs["dp2"]
    assert "phases: pairs -> reference_model -> preference_update" in proc.stdout
    first, second = train[1], train[2]
    assert all(k in first for k in KEYS), sorted(set(KEYS) - set(first))
    # the reference is the policy the run started from: at the first step every implicit
    # reward is 0 and the sigmoid loss is log 2
    assert first["actor/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    # one step later the chosen responses gained on the rejected ones
    assert second["actor/loss"] < first["actor/loss"]
    assert second["rewards/margins"] > 0 and second["rewards/accuracies"] > 0.5
    assert second["logps/chosen"] > first["logps/chosen"]
    # the evaluation's vLLM engine: greedy accuracy before and after
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["iteration"] for r in evals] == [0, 2]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_give_the_dp_numbers(runs, layout):
    _, base, _ = runs["dp2"]
    _, train, _ = runs[layout]
    assert train[1]["actor/grad_norm"] == pytest.approx(base[1]["actor/grad_norm"], rel=1e-5)
    for key in ("actor/loss", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert train[2][key] == pytest.approx(base[2][key], rel=1e-5, abs=1e-5), key


def test_a_resumed_run_equals_the_uninterrupted_one(runs):
    _, base, _ = runs["dp2"]
    proc, train, _ = runs["resumed"]
    assert sorted(train) == [2]  # iteration 1 came from the checkpoint
    for key in ("actor/loss", "actor/grad_norm", "rewards/margins", "logps/chosen",
                "pairs/chosen_length_mean"):
        assert train[2][key] == base[2][key], key
