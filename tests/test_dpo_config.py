"""DPO's config (pretrain_dpo.py): MindSpeed-LLM's keys, what they mean here, their refusals,
the plan of a pairs job, and pairs kept whole by the micro-batch planner (pure Python)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.config import load_config, main, make_plan
from mindspeed_rl.engine.micro_batches import MicroBatching, RowBatch, make_micro_batches
from test_config import error_of, job  # noqa: F401 (job: the fixture; tests/ on sys.path)

DPO = {"stage": "dpo", "is_pairwise_dataset": True, "dpo_beta": 0.2}


def _dpo(job, **mt):
    return job(megatron_training={**DPO, **mt}, rl_config=None, generate_config=None)


def test_their_keys_load_with_their_meaning(job):
    config = load_config(_dpo(job, ref_model="./ref_ckpt", dpo_loss_type="ipo",
                              pref_ftx=0.5), check_data=False, algorithm="dpo")
    mt, rl = config.megatron_training, config.rl_config
    assert (mt.dpo_loss_type, mt.dpo_beta, mt.pref_ftx) == ("ipo", 0.2, 0.5)
    assert config.ref_config.load.endswith("ref_ckpt")     # ref_model -> ref_config.load
    assert rl.n_samples_per_prompt == 2 and rl.mini_batch_size == 4   # a pair; one step
    assert rl.ref_forward_micro_batch_size == 2 * config.actor_config.micro_batch_size
    assert config.features.phases == ("pairs", "reference_model", "preference_update")
    assert config.features.reference and config.features.pairs
    assert not config.features.engine                      # no test data: no vLLM


def test_the_plan_counts_pairs_and_builds_no_engine_without_evaluation(job, capsys):
    path = _dpo(job, global_batch_size=8)
    config = load_config(path, ["actor_config.micro_batch_size=2",
                                "actor_config.tensor_model_parallel_size=1"],
                         check_data=False, algorithm="dpo")
    plan = make_plan(config, 2)
    assert plan.batch.responses_per_training_dp_rank == 8      # 4 pairs per DP rank
    assert plan.batch.micro_batches_per_mini_batch == 2        # 4 pairs / 2 per micro-batch
    assert "vllm_weights" not in plan.memory_bytes
    assert main(["--config", str(path), "--dry-run", "--world-size", "2",
                 "actor_config.tensor_model_parallel_size=1"], algorithm="dpo") == 0
    out = capsys.readouterr().out
    assert "phases: pairs -> reference_model -> preference_update" in out
    assert "pairs (megatron_training.global_batch_size)" in out
    assert "generation (vLLM)" not in out and "rollout:" not in out
    assert "loss: DPO sigmoid (pretrain_dpo.py), beta 0.2" in out


@pytest.mark.parametrize("mt, rl, algorithm, key, text", [
    ({"is_pairwise_dataset": False}, {}, "dpo", "megatron_training.is_pairwise_dataset",
     "trains on preference pairs"),
    ({"dpo_loss_type": "hinge", "dpo_label_smoothing": 0.1}, {}, "dpo",
     "megatron_training.dpo_label_smoothing", "only the sigmoid loss reads it"),
    ({"dpo_label_smoothing": 0.5}, {}, "dpo", "megatron_training.dpo_label_smoothing",
     "in [0, 0.5)"),
    ({"dpo_beta": 0.0}, {}, "dpo", "megatron_training.dpo_beta", "must be positive"),
    ({"refer_model_iter": 5}, {}, "dpo", "megatron_training.refer_model_iter",
     "reloads the reference"),
    ({}, {"n_samples_per_prompt": 4}, "dpo", "rl_config.n_samples_per_prompt",
     "a DPO pair is 2 rows"),
    ({}, {"n_samples_per_prompt": 2, "mini_batch_size": 2}, "dpo", "rl_config.mini_batch_size",
     "one optimizer step"),
    ({"dpo_loss_type": "kto_pair"}, {}, "dpo", "megatron_training.dpo_loss_type", ""),
    ({}, {}, "grpo", "megatron_training.stage", "launch pretrain_dpo.py"),
])
def test_what_a_dpo_job_cannot_run_is_refused_by_name(job, mt, rl, algorithm, key, text):
    path = job(megatron_training={**DPO, **mt}, rl_config=rl or None, generate_config=None)
    error = error_of(load_config, path, check_data=False, algorithm=algorithm)
    assert error.startswith(key) and text in error, error


def test_a_pairwise_dataset_given_to_grpo_is_refused(job):
    error = error_of(load_config, job(megatron_training={"is_pairwise_dataset": True}),
                     check_data=False)
    assert error.startswith("megatron_training.is_pairwise_dataset=true")
    assert "pretrain_dpo.py" in error


@pytest.mark.parametrize("spec", [MicroBatching(micro_batch_size=2),
                                  MicroBatching(micro_batch_size=2, max_tokens=16,
                                                packed=True),
                                  MicroBatching(micro_batch_size=1, max_tokens=30)])
def test_micro_batches_never_split_a_pair(spec):
    """Rows 2i (chosen) and 2i + 1 (rejected) stay together whatever the layout packs."""
    lengths = [(3, 2), (3, 5), (4, 1), (4, 6), (2, 2), (2, 1)]
    batch = RowBatch([torch.ones(p, dtype=torch.long) for p, _ in lengths],
                     [torch.ones(r, dtype=torch.long) for _, r in lengths], {})
    micro = make_micro_batches(batch, spec, rows_per_unit=2)
    rows = sorted(r for mb in micro for r in mb.rows)
    assert rows == list(range(6))
    for mb in micro:
        assert all((r ^ 1) in mb.rows for r in mb.rows), mb.rows
    assert len(micro) > 1
