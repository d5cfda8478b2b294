"""PPO end to end on CPU: torchrun + pretrain_ppo.py, megatron actor and critic + vLLM, 2 ranks,
tiny random model; the reward-model path; resume; bad input.

Runs the launcher as a user does (a subprocess under torchrun) and reads back metrics.jsonl.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torchrun_jobs import ROOT, run_job, stopped_at, training_rows

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "ppo_tiny_test.yaml"
REQUIRED_KEYS = [
    "timing/all", "timing/rollout", "timing/reward", "timing/values", "timing/gae",
    "timing/critic_update", "timing/reference_model", "timing/old_log_p",
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/explained_variance",
    "critic/grad_norm", "critic/lr", "critic/returns_mean", "actor/kl_coef",
    "actor/reward_kl_penalty", "reward/mean", "response_length/mean",
    "throughput/e2e_tokens_per_s_per_device",
]
ACTOR_KEYS = ["actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm",
              "actor/lr", "rollout/logprob_abs_diff_max", "timing/update"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    train, test = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(test, root / "test.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl", "test": root / "test.jsonl"}


def launch(assets, run: str, *overrides: str, launcher: str = "pretrain_ppo.py",
           config: Path = CONFIG, **kwargs):
    return run_job(assets, run, *overrides, launcher=launcher, config=config, **kwargs)


LAYOUTS = {
    "tp2_to_tpg1": ["actor_config.tensor_model_parallel_size=2",
                    "generate_config.infer_tensor_parallel_size=1"],
    "pp2_to_tpg2": ["actor_config.tensor_model_parallel_size=1",
                    "actor_config.pipeline_model_parallel_size=2",
                    "generate_config.infer_tensor_parallel_size=2"],
}
# The layout run that saves every iteration: the resume test's uninterrupted run.
RESUMED_LAYOUT = "tp2_to_tpg1"


def layout_overrides(assets, name: str) -> list[str]:
    return [f"megatron_training.test_data_path={assets['test']}", *LAYOUTS[name]]


@pytest.fixture(scope="module")
def layout_run(assets):
    """3 iterations at a layout, run once per module: (process, metrics rows)."""
    done = {}

    def run(name: str):
        if name not in done:
            save = (["megatron_training.save_interval=1",
                     f"actor_config.save={assets['root'] / 'ppo_full'}"]
                    if name == RESUMED_LAYOUT else [])
            done[name] = launch(assets, f"run_{name}", *layout_overrides(assets, name), *save)
        return done[name]
    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ppo_iterations_complete_with_all_metrics(layout_run, name):
    proc, rows = layout_run(name)
    train = training_rows(rows)
    assert sorted(train) == [1, 2, 3]
    for it, row in train.items():
        missing = [k for k in REQUIRED_KEYS if k not in row]
        assert not missing, (it, missing)
        for k in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "reward/mean"):
            assert row[k] is not None and math.isfinite(row[k]), (it, k, row[k])
    # critic_warmup: 1 -> the actor does not update in iteration 1, then it does
    assert not any(k in train[1] for k in ACTOR_KEYS if not k.startswith("timing/"))
    for it in (2, 3):
        missing = [k for k in ACTOR_KEYS if k not in train[it]]
        assert not missing, (it, missing)
        assert math.isfinite(train[it]["actor/pg_loss"]) and train[it]["actor/grad_norm"] > 0
        assert train[it]["rollout/logprob_abs_diff_max"] < 1e-3
    # The adaptive KL controller (kl_ctrl_type: adaptive, kl_target: 0.1, kl_horizon: 100, as
    # MindSpeed-RL's and verl's read them) moves the coefficient after each batch of 8
    # samples by their rule, from the batch's KL per token: down while it is below target.
    coefs = [train[it]["actor/kl_coef"] for it in (1, 2, 3)]
    kls = [train[it]["actor/reward_kl_penalty"] for it in (1, 2, 3)]
    assert coefs[0] == pytest.approx(0.01) and kls[0] == pytest.approx(0.0, abs=1e-6)
    for it in (0, 1):
        error = min(max(kls[it] / 0.1 - 1.0, -0.2), 0.2)
        assert coefs[it + 1] == pytest.approx(coefs[it] * (1 + error * 8 / 100), rel=1e-9)
        assert (coefs[it + 1] < coefs[it]) == (kls[it] < 0.1)
    assert [r["iteration"] for r in rows if "eval/accuracy" in r] == [0, 3]
    assert "phases: resharding_to_infer -> rollout -> resharding_to_train -> reward -> values " \
           "-> old_log_p -> reference_model -> gae -> critic_update -> update" in proc.stdout


def test_ppo_resume_reproduces_uninterrupted_run(assets, layout_run):
    """Stop after 2 of 3 iterations, resume: iteration 3 (actor and critic) is identical.
    The uninterrupted run is the TP=2 layout run above, saving every iteration; the stopped
    one is its checkpoint of iteration 2 (tests/torchrun_jobs.py: stopped_at)."""
    _, full = layout_run(RESUMED_LAYOUT)
    full_ckpt, part_ckpt = assets["root"] / "ppo_full", assets["root"] / "ppo_part"
    stopped_at(full_ckpt, 2, part_ckpt)
    _, resumed = launch(assets, "part", *layout_overrides(assets, RESUMED_LAYOUT),
                        f"actor_config.load={part_ckpt}", f"actor_config.save={part_ckpt}")
    full, resumed = training_rows(full), training_rows(resumed)
    assert sorted(resumed) == [3]
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
                "actor/grad_norm", "actor/kl_coef", "critic/vf_loss", "critic/grad_norm",
                "critic/vpred_mean", "critic/explained_variance", "critic/returns_mean"):
        assert resumed[3][key] == pytest.approx(full[3][key], rel=1e-6, abs=1e-9), key


def test_reward_model_scores_join_the_reward(assets, tmp_path_factory):
    """A tiny sequence-classification reward model (GRPO + PPO use the same phase)."""
    rm = make_tiny_hf_dir("qwen2", assets["root"] / "qwen2_rm", sequence_classification=True)
    _, rows = launch(assets, "with_rm", "megatron_training.train_iters=1",
                     f"reward_config.load={rm}", "reward_config.weight=0.5",
                     launcher="pretrain_grpo.py", config=ROOT / "configs" / "grpo_tiny_test.yaml")
    row = training_rows(rows)[1]
    assert "timing/reward_model" in row and math.isfinite(row["reward_model/score/mean"])
    assert row["reward_model/score/min"] < row["reward_model/score/max"]


@pytest.mark.parametrize("overrides, message", [
    (["rl_config.critic_warmup=3"], "rl_config.critic_warmup=3: must be smaller than "
                                    "megatron_training.train_iters=3"),
    (["critic_config.tensor_model_parallel_size=4"],
     "critic_config.tensor_model_parallel_size=4: differs from "
     "actor_config.tensor_model_parallel_size=2"),
], ids=["warmup", "critic_layout"])
def test_bad_ppo_config_fails_before_any_process_group(assets, overrides, message):
    proc, _ = launch(assets, "bad", *overrides, check=False, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("kind, message", [
    ("causal_lm", "has no score head"),
    ("other_vocab", "vocabulary of 512 tokens, but the actor's has 384"),
], ids=["no_score_head", "other_vocabulary"])
def test_unusable_reward_model_is_refused_at_start(assets, kind, message):
    rm = assets["root"] / f"rm_{kind}"
    if kind == "causal_lm":
        make_tiny_hf_dir("qwen2", rm)
    else:
        make_tiny_hf_dir("qwen2", rm, sequence_classification=True, vocab_size=512)
    proc, _ = launch(assets, f"bad_rm_{kind}", "megatron_training.train_iters=1",
                     f"reward_config.load={rm}", launcher="pretrain_grpo.py",
                     config=ROOT / "configs" / "grpo_tiny_test.yaml", check=False, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "pretrain_grpo.py: error:" in proc.stderr
    # Refused from its files, before vLLM was built (its CPU worker logs its NUMA binding).
    assert "init_cpu_memory_env" not in proc.stderr, proc.stderr[-3000:]
