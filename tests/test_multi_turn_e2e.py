"""GRPO with multi-turn rollouts end to end: torchrun + pretrain_grpo.py, 2 ranks, a tiny
model, the real code interpreter behind a scripted parser (tests/scripted_tools.py: a
random model writes no tool calls), checkpoint and resume. Partial rollout with multi-turn
on two DP ranks is checked on the launch of tests/test_router_replay_e2e.py."""

from __future__ import annotations

import pytest
from torchrun_jobs import (MULTI_TURN, ROOT, SCRIPTED_TOOLS_ENV, run_job, stopped_at,
                          training_rows)

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_turn")
    train, test = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(test, root / "test.jsonl")
    model = make_tiny_hf_dir("qwen2", root / "qwen2", max_position_embeddings=2048)
    return {"root": root, "model": model, "data": root / "train.jsonl", "test": root / "test.jsonl"}


def launch(assets, run: str, *overrides: str):
    return run_job(assets, run, *MULTI_TURN, *overrides, launcher="pretrain_grpo.py",
                   config=CONFIG, env=SCRIPTED_TOOLS_ENV)


def test_multi_turn_grpo_trains_on_the_model_tokens_and_resumes_exactly(assets):
    full_ckpt = assets["root"] / "ckpt_full"
    first, rows = launch(assets, "full", "megatron_training.train_iters=3",
                     "megatron_training.save_interval=2", f"actor_config.save={full_ckpt}")
    train = training_rows(rows)
    assert sorted(train) == [1, 2, 3]
    for it, row in train.items():
        # every trajectory called the (scripted) tool, at most max_tool_calls times
        assert row["multi_turn/tool_call_rate"] == 1.0, it
        assert 1.0 <= row["multi_turn/tool_calls"] <= 2.0 and row["multi_turn/turns"] >= 2.0
        assert row["multi_turn/tool_error_rate"] == row["multi_turn/tool_timeout_rate"] == 0
        assert row["multi_turn/tool_tokens"] > 0 and row["multi_turn/model_tokens"] > 0
        # 4 prompts x 4 samples: every response token is the model's or not
        assert row["response_length/mean"] * 16 == pytest.approx(
            row["multi_turn/model_tokens"] + row["multi_turn/tool_tokens"])
        # the update's loss covered exactly the model's tokens: 2 optimizer steps (mini-batch
        # 2 of 4 prompts), each reporting its own token count
        assert row["actor/loss_tokens"] * 2 == row["multi_turn/model_tokens"], it
        assert row["response_length/max"] <= 112
        assert row["timing/tools"] > 0
        # vLLM and megatron agree on the weights' log-probs: every prompt shares the long
        # tool description, whose prefix-cached blocks must not outlive a weight load
        # (before the reset this gap was 0.11 at iteration 3)
        assert row["rollout/logprob_abs_diff_max"] < 1e-3, it
    # resume from the checkpoint of iteration 2: iteration 3 repeats the uninterrupted one,
    # also with the step-wise loop (async_engine): every trajectory's turns are seeded on
    # their own, so they come out the same whichever turns share a decode batch
    assert "rollout: fresh prompts x tool turns x one pass (batch-wide turns" in first.stdout
    part = stopped_at(full_ckpt, 2, assets["root"] / "ckpt_part")
    proc, resumed = launch(assets, "part", "megatron_training.train_iters=3",
                           f"actor_config.load={part}", f"actor_config.save={part}",
                           "rl_config.async_engine=true",
                           f"megatron_training.test_data_path={assets['test']}",
                           "megatron_training.num_test_prompts=4")
    assert "rollout: fresh prompts x tool turns x step-wise (each trajectory continues" in \
        proc.stdout
    again = training_rows(resumed)
    assert sorted(again) == [3]
    # the evaluation after the last iteration runs the policy with its tools (the agent loop,
    # greedy) and without them, each on the 4 test prompts
    evaluation, = [r for r in resumed if "eval/accuracy" in r]
    assert evaluation["iteration"] == 3 and evaluation["eval/num_prompts"] == 4
    assert evaluation["eval/tool_call_rate"] == 1.0  # the scripted parser calls the tool
    assert 0.0 <= evaluation["eval/accuracy"] <= 1.0
    assert 0.0 <= evaluation["eval/accuracy_without_tools"] <= 1.0
    for key in ("reward/mean", "multi_turn/model_tokens", "multi_turn/tool_tokens",
                "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                "response_length/mean"):
        assert again[3][key] == pytest.approx(train[3][key], rel=1e-6, abs=1e-9), key


def test_context_parallel_with_lora_partial_rollout_and_multi_turn(assets):
    """The features that slice or extend rows, all at once on a CP 2 ring: each multi-turn
    row (tool tokens masked out of the loss) resumed across partial-rollout passes is cut
    into zig-zag chunks for the LoRA actor and the reference (the frozen base behind the
    adapters). The log-probs that come back in token order equal vLLM's on fresh rows, and
    the loss covers the model's tokens of every row once."""
    _, rows = launch(assets, "cp_lora", "megatron_training.train_iters=2",
                     "rl_config.partial_rollout_max_split=2",
                     "actor_config.tensor_model_parallel_size=1",
                     "actor_config.context_parallel_size=2",
                     "actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,"
                     "linear_fc2]", "actor_config.lora_r=4", "actor_config.lora_alpha=8",
                     "rl_config.share_backbone=true")
    train = training_rows(rows)
    assert sorted(train) == [1, 2]
    fresh = train[1]  # cut after pass 1 and resumed in pass 2 under the same weights
    assert fresh["partial_rollout/passes"] >= 2 and fresh["partial_rollout/trained_age_max"] == 0
    assert fresh["rollout/logprob_abs_diff_max"] < 1e-3
    for it, row in train.items():
        assert row["multi_turn/tool_tokens"] > 0, it
        # each CP rank counts its own chunks' loss tokens: together every model token once
        assert row["actor/loss_tokens"] * 2 == row["multi_turn/model_tokens"], it
    assert train[2]["partial_rollout/trained_age_max"] == 1  # carried rows trained a step late
