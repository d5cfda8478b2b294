"""Routing replay end to end (torchrun, 2 ranks, GRPO on a tiny Qwen3-MoE with 16 experts,
top-2): R3 with partial rollout and multi-turn (the real code interpreter behind the scripted
parser of tests/scripted_tools.py) records vLLM's routes, carries them with the rows across
tool turns and iterations (resumed rows included) and replays them in the old-log-prob,
reference and update passes: the update's dispatched routing differs from the rollout's on
no (token, layer), every iteration. One launch carries all three features, and is also the
run of partial rollout with multi-turn on two DP ranks (tests/test_multi_turn_e2e.py has
the same pair on a CP 2 ring with LoRA): every trained group whole and trained once, no
row older than N - 1, the loss on the model's tokens only."""

from __future__ import annotations

import pytest
from torchrun_jobs import (MULTI_TURN, ROOT, SCRIPTED_TOOLS_ENV, run_job, sample_flow_traces,
                          training_rows, updated_rows)

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay_e2e")
    train, _ = make_arithmetic_problems(15, 1, seed=0, max_operand=4, ops="+")
    write_jsonl(train, root / "train.jsonl")
    assets = {"root": root, "data": root / "train.jsonl",
              "model": make_tiny_hf_dir("qwen3_moe", root / "moe", num_experts=16,
                                        num_experts_per_tok=2, max_position_embeddings=2048)}
    _, rows = run_job(assets, "r3", "rl_config.router_replay=R3", *MULTI_TURN,
                      "rl_config.partial_rollout_max_split=2", "rl_config.log_sample_flow=true",
                      "generate_config.enable_prefix_caching=false",
                      "actor_config.tensor_model_parallel_size=1",
                      "megatron_training.train_iters=3",
                      launcher="pretrain_grpo.py", config=CONFIG, env=SCRIPTED_TOOLS_ENV)
    return {"train": training_rows(rows), "traces": sample_flow_traces(assets, "r3")}


def test_r3_replays_the_rollout_routing_every_iteration(run):
    run = run["train"]
    assert sorted(run) == [1, 2, 3]
    assert any(row["rollout/off_policy_token_fraction"] == 0 for row in run.values())
    for it, row in run.items():
        assert row["multi_turn/tool_tokens"] > 0, it  # tool turns were fed between model turns
        assert row["routing/diff_fraction"] == 0.0, it
        assert row["routing/diff_fraction_max_layer"] == 0.0, it
        if row["rollout/off_policy_token_fraction"] == 0:  # every token of these weights:
            # megatron with the replayed routes gives vLLM's log-probs, which it does only
            # if each token's routes are its own (a route column out of step with the
            # tokens, e.g. turns carried in the wrong order, gave 2.2 here)
            assert row["rollout/logprob_abs_diff_max"] < 1e-3, it


def test_partial_rollout_with_multi_turn_trains_whole_groups_once_and_young(run):
    """partial_rollout_max_split 2 with the agent loop: each pass continues a trajectory for
    at most half of max_total_response_length in model tokens (tool turns included), so the
    three-turn trajectories (24-token turns, two scripted calls) stop mid-turn or after a
    tool turn and resume in the next pass."""
    run, traces = run["train"], run["traces"]
    # each iteration traced by both DP ranks
    assert [len(per_rank) for per_rank in traces] == [2, 2, 2]
    trained = []
    for it, per_rank in enumerate(traces, start=1):
        released = per_rank[0]["partial_rollout/released_round0"]
        updated = updated_rows(per_rank)
        assert updated == released and len(released) == 4 * 4, it  # whole groups, once
        trained += updated
        row = run[it]
        assert row["partial_rollout/trained_age_max"] <= 1, it
        assert row["multi_turn/model_tokens"] > 0
        # the loss covered exactly the model's tokens (2 optimizer steps, each its own count)
        assert row["actor/loss_tokens"] * 2 == row["multi_turn/model_tokens"], it
        assert row["response_length/max"] <= 112
    assert len(trained) == len(set(trained))
    # trajectories really were cut and carried (resumed in a later iteration), and some
    # trained ones were
    assert any(row.get("rollout/off_policy_token_fraction", 0) > 0 for row in run.values())
    assert max(r["partial_rollout/carried_unfinished_rows"] for r in run.values()) > 0
    assert max(r["partial_rollout/trained_age_max"] for r in run.values()) >= 1
    assert max(r["partial_rollout/passes"] for r in run.values()) >= 2
