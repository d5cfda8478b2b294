"""GRPO on the tiny DeepSeek-V3 end to end: torchrun + pretrain_grpo.py on 2 ranks with the
experts split over EP 2 (multi-latent attention, sigmoid router with expert bias, shared
expert, first layer dense); vLLM's MLA model takes the weights through the allgather-swap."""

from __future__ import annotations

import pytest
from torchrun_jobs import ROOT, run_job, training_rows

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3_grpo")
    train, _ = make_arithmetic_problems(32, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("deepseek_v3", root / "ds"),
            "data": root / "train.jsonl"}


def test_grpo_with_expert_parallelism_runs_every_phase(assets):
    proc, rows = run_job(assets, "ep2", "megatron_training.train_iters=3",
                         "actor_config.tensor_model_parallel_size=1",
                         "actor_config.expert_model_parallel_size=2",
                         launcher="pretrain_grpo.py", config=ROOT / "configs" / "grpo_tiny_test.yaml")
    assert "8 routed per MoE layer over EP 2 x expert TP 1: 4 per rank" in proc.stdout + proc.stderr
    train = training_rows(rows)
    assert sorted(train) == [1, 2, 3]
    for it, row in train.items():
        # fresh rows every iteration: vLLM's MLA model has this step's weights
        assert row["rollout/logprob_abs_diff_max"] <= 1e-3, it
        assert row["actor/grad_norm"] > 0, it
