"""The sample-flow contract: every column declared once, with producers and consumers,
and phases that put or get outside it are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mindspeed_rl.testing.multiprocess import run_on_ranks
from mindspeed_rl.trainer.columns import (COLUMNS, Column, ContractError, active_columns,
                                          check_contract)
from mindspeed_rl.trainer.recipes import PHASES, recipes

RECIPES = recipes()  # every (family, estimator) pair's phases
GRPO, PPO = RECIPES["grpo/group_norm"], RECIPES["ppo/gae"]


def test_the_contract_holds_for_every_algorithm():
    check_contract(RECIPES)
    assert set(p for phases in RECIPES.values() for p in phases) == set(PHASES)
    for col in COLUMNS.values():  # every column is read by someone in some algorithm
        assert col.consumers and col.producers, col.name


def test_a_column_nobody_reads_is_refused():
    orphan = Column("scratch", torch.float32, "[R]", ("values",), (), "written, never read")
    with pytest.raises(ContractError, match="'scratch' has no consumer"):
        check_contract(RECIPES, [*COLUMNS.values(), orphan])


def test_a_column_read_before_it_is_written_is_refused():
    late = dataclasses.replace(COLUMNS["rewards"], consumers=("rollout",))
    with pytest.raises(ContractError, match="'rollout' reads column 'rewards' before"):
        check_contract(RECIPES, [c if c.name != "rewards" else late
                                    for c in COLUMNS.values()])


def test_unknown_phases_are_refused():
    ghost = dataclasses.replace(COLUMNS["values"], producers=("oracle",))
    with pytest.raises(ContractError, match="'oracle'"):
        check_contract(RECIPES, [ghost])


def test_each_algorithm_stores_only_what_it_reads():
    grpo, ppo = active_columns(GRPO), active_columns(PPO)
    assert {"values", "returns"} <= ppo and not {"values", "returns"} & grpo
    assert {"group_id", "sample_idx"} <= grpo and not {"group_id", "sample_idx"} & ppo
    for name in grpo | ppo:  # what is stored has a producer and a consumer in the algorithm
        algos = [phases for phases in RECIPES.values() if name in active_columns(phases)]
        assert all(set(COLUMNS[name].consumers) & set(phases) for phases in algos)


def _flow_misuse() -> dict:
    from mindspeed_rl.trainer.flow import SampleFlow
    from mindspeed_rl.transfer_dock import ConsumerLayout, build_transfer_dock

    flow = SampleFlow(build_transfer_dock("distributed", timeout_s=60), GRPO,
                      {"all": ConsumerLayout(((0,),))})
    ids = [torch.arange(3)]
    errors = {}
    attempts = {
        "undeclared": lambda: flow.put_rows("rollout", {"prompt_ids": ids, "secret": ids},
                                            group_size=1),
        "not_producer": lambda: flow.put_rows("reward", {"prompt_ids": ids}, group_size=1),
        "wrong_dtype": lambda: flow.put_rows("rollout", {"prompt_ids": [torch.ones(3)]},
                                             group_size=1),
        "not_consumer": lambda: flow.get("reward", ["prompt_ids"], 1, "all"),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = "no error"
        except ContractError as e:
            errors[name] = str(e)
    # GRPO reads no values: the rollout's row put keeps prompt_ids, drops nothing declared.
    rows = flow.put_rows("rollout", {"prompt_ids": ids, "response_ids": ids}, group_size=1)
    batch = flow.get("update", ["prompt_ids", "response_ids"], 1, "all")
    errors["delivered"] = batch.rows == rows and batch["prompt_ids"][0].tolist() == [0, 1, 2]
    return errors


def test_phases_that_leave_the_contract_are_refused():
    errors = run_on_ranks(_flow_misuse, 1, timeout=120)[0]
    assert "'secret', which the column contract" in errors["undeclared"]
    assert "lets only ['rollout', 'pairs'] put it" in errors["not_producer"]
    assert "declares torch.int64 [P]" in errors["wrong_dtype"]
    assert "phase 'reward' gets column 'prompt_ids'" in errors["not_consumer"]
    assert errors["delivered"] is True


def test_docs_show_the_contract():
    from pathlib import Path

    from mindspeed_rl.trainer.columns import markdown_table

    docs = (Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text()
    assert markdown_table() in docs
