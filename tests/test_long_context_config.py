"""Context parallelism in the config and the dry run (pure Python, no torch).

MindSpeed-RL's 20k- and 32k-token DAPO configs (TP 8 x CP 2 ring x PP 2, 64 NPUs) pass the
dry run as they are, the plan showing CP and the per-rank activations it halves; Ulysses
at their TP 8 is refused naming the keys (Qwen2.5-32B's 40 query and 8 KV heads do not split
over 16 ranks) and accepted at TP 4; other bad input names its key.
"""

from __future__ import annotations

import pytest

from mindspeed_rl.config import load_config, main, make_plan
from mindspeed_rl.config.checks.training_features import check_runnable
from mindspeed_rl.config.mindspeed_keys import HONOURED, ROWS
from test_mindspeed_rl_config import error_of  # (tests/ is on sys.path: conftest.py)
from test_mindspeed_rl_history import MSRL, _show

COMMIT = "6628b6e"
CONFIGS = ["dapo_qwen25_32b_A2_20k.yaml", "dapo_qwen25_32b_A3_32k.yaml"]
UPDATE_TOKENS = {CONFIGS[0]: "22,528", CONFIGS[1]: "32,768"}  # update_max_packing_token_size

pytestmark = pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror")


@pytest.fixture
def msrl(tmp_path, monkeypatch):
    """Their config and model yamls, unchanged, in a temporary folder."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "qwen25_32b.yaml").write_text(
        _show(COMMIT, "configs/model/qwen25_32b.yaml"))
    for name in CONFIGS:
        (tmp_path / name).write_text(_show(COMMIT, f"configs/{name}"))
    monkeypatch.chdir(tmp_path)
    return lambda name, *overrides: load_config(name, list(overrides), check_data=False,
                                                algorithm="grpo")


@pytest.mark.parametrize("name", CONFIGS)
def test_their_long_context_configs_plan_cp2_at_64_ranks(msrl, name, capsys):
    config = msrl(name)
    a = config.actor_config
    assert (a.context_parallel_size, a.context_parallel_algo, a.attention_mask_type) == (
        2, "megatron_cp_algo", "causal")
    plan = make_plan(config, 64)
    train = plan.to_dict()["layout"]["training"]
    assert (train["tensor_model_parallel_size"], train["context_parallel_size"],
            train["pipeline_model_parallel_size"], train["data_parallel_size"]) == (8, 2, 2, 2)
    table = plan.format()
    assert "TP   CP   PP   DP   EP   SP" in table
    assert "     8    2    2    2    1   on" in table
    assert (f"activations (update micro-batch: {UPDATE_TOKENS[name]} tokens / CP=2, 2 in "
            "flight)") in table
    # CP 2 halves each rank's activations and logits (same tokens, half per rank)
    single = make_plan(msrl(name, "actor_config.context_parallel_size=1"), 64)
    assert single.layout.data_parallel_size == 4
    for key in ("activations", "logits"):
        assert plan.memory_bytes[key] * 2 == pytest.approx(single.memory_bytes[key], rel=1e-3)
    assert main(["--config", name, "--dry-run", "--world-size", "64"]) == 0
    assert "dry-run OK" in capsys.readouterr().out


def test_ulysses_needs_heads_divisible_by_tp_times_cp(msrl):
    name = CONFIGS[1]
    text = str(error_of(make_plan, msrl(name, "actor_config.context_parallel_algo=ulysses_cp_algo"),
                        64))
    assert text.startswith(
        "actor_config.context_parallel_algo='ulysses_cp_algo' shards attention heads over "
        "actor_config.tensor_model_parallel_size=8 x actor_config.context_parallel_size=2 = 16 "
        "ranks, which does not divide the model's num_attention_heads=40"), text
    assert "context_parallel_algo: megatron_cp_algo" in text
    plan = make_plan(msrl(name, "actor_config.context_parallel_algo=ulysses_cp_algo",
                          "actor_config.tensor_model_parallel_size=4"), 64)
    assert (plan.layout.tensor_model_parallel_size, plan.layout.context_parallel_size,
            plan.layout.data_parallel_size) == (4, 2, 4)
    # KV heads too: 8 KV heads over TP 4 x CP 4
    text = str(error_of(make_plan, msrl(name, "actor_config.context_parallel_algo=ulysses_cp_algo",
                                        "actor_config.tensor_model_parallel_size=2",
                                        "actor_config.context_parallel_size=10"), 80))
    assert "does not divide the model's num_key_value_heads=8" in text


def test_cp_must_divide_the_ranks_left_by_tp_and_pp(msrl):
    text = str(error_of(make_plan, msrl(CONFIGS[0]), 48))
    assert text.startswith("actor_config.context_parallel_size=2 does not divide world_size=48 "
                           "/ (actor_config.tensor_model_parallel_size=8 x "
                           "actor_config.pipeline_model_parallel_size=2) = 3 ranks"), text
    assert "world sizes this config accepts: 32, 64, 128, 256" in text


def test_only_causal_masks(msrl):
    text = str(error_of(msrl, CONFIGS[0], "actor_config.attention_mask_type=general"))
    assert text.startswith("actor_config.attention_mask_type='general': only causal attention "
                           "is built here"), text


def test_rows_longer_than_max_model_len_stop_there(msrl):
    """vLLM stops a response at max_model_len: a warning, and the longest row the packing
    budgets must hold is max_model_len; a prompt limit that fills it is refused."""
    config = msrl(CONFIGS[1], "generate_config.sampling_config.max_tokens=32000")
    assert config.warnings[-1].startswith(
        "generate_config.sampling_config.max_tokens=32000: rl_config.max_prompt_length=2048 + "
        "max_tokens=32000 = 34048 is larger than generate_config.max_model_len=32768: vLLM "
        "stops the response to a longest prompt at max_model_len, 1280 tokens short of "
        "max_tokens"), config.warnings
    text = str(error_of(msrl, CONFIGS[1], "generate_config.sampling_config.max_tokens=32000",
                        "rl_config.update_max_packing_token_size=32000"))
    assert text.startswith("rl_config.update_max_packing_token_size=32000: smaller than the "
                           "longest single row: rl_config.max_prompt_length=2048 + generate_"
                           "config.sampling_config.max_tokens=32000 = 34048 tokens, cut at "
                           "generate_config.max_model_len=32768"), text
    text = str(error_of(msrl, CONFIGS[1], "rl_config.max_prompt_length=32768",
                        "megatron_training.seq_length=32768"))
    assert text.startswith("rl_config.max_prompt_length=32768: a longest prompt leaves no room "
                           "for a response in generate_config.max_model_len=32768"), text


def test_a_launch_with_cp_and_a_critic_is_refused(msrl):
    """CP runs the policy and the reference; a scalar-head model with CP is refused before
    any process group."""
    from dataclasses import replace

    from mindspeed_rl.config.schema import CriticConfig

    config = msrl(CONFIGS[0])
    check_runnable(config)
    text = str(error_of(check_runnable, replace(config, critic_config=CriticConfig())))
    assert text.startswith("actor_config.context_parallel_size=2: context parallelism runs the "
                           "policy and the reference here, not PPO's critic"), text


def test_cp_keys_are_honoured_keys():
    rows = {r.name: r for r in ROWS if not r.history}
    for key in ("context_parallel_size", "context_parallel_algo", "attention_mask_type"):
        assert rows[key].handling == HONOURED and rows[key].detail == f"actor_config.{key}"
