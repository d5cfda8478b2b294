"""The rollout from parts (``mindspeed_rl/trainer/rollout_parts/``): every composition of
{fresh prompts, carried rows} x {single turn, tool turns} x {one pass, step-wise} runs through
the trainer's rollout phase on the real vLLM engine, a real TransferDock and (tool turns) the
real code interpreter, and logs the same metric keys wherever they apply: the rows'
lengths always, the tool statistics with tool turns, the pool's with carried rows. Then
docs/architecture.md's new rollout mode (a scheduler whose per-pass budget doubles) runs
through the same loop.

One rank and one engine for all; each composition gets its own dock; those with carried
rows run two iterations (the second continues the carried rows of the first).
"""

from __future__ import annotations

import itertools

import pytest
from torchrun_jobs import MULTI_TURN, ROOT

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
COMBOS = list(itertools.product((False, True), repeat=3))  # (carried, tools, step-wise)
ROWS = ["response_length/mean", "response_length/min", "response_length/max",
        "prompt_length/mean", "tokens/response", "tokens/prompt"]
TOOLS = ["multi_turn/turns", "multi_turn/turns_max", "multi_turn/tool_calls",
         "multi_turn/tool_calls_max", "multi_turn/tool_call_rate", "multi_turn/model_tokens",
         "multi_turn/tool_tokens", "multi_turn/tool_error_rate", "multi_turn/tool_timeout_rate",
         "timing/tools"]
POOL = ["partial_rollout/passes", "partial_rollout/carried_rows",
        "partial_rollout/carried_unfinished_rows", "partial_rollout/carried_tokens",
        "partial_rollout/carried_age_max", "partial_rollout/trained_age_mean",
        "partial_rollout/trained_age_max", "partial_rollout/dropped_groups"]


def _overrides(model: str, data: str, carried: bool, tools: bool, stepwise: bool) -> list[str]:
    out = [f"megatron_training.model={model}", f"megatron_training.data_path={data}",
           "actor_config.tensor_model_parallel_size=1", "generate_config.max_model_len=1120",
           "megatron_training.global_batch_size=2",
           f"rl_config.partial_rollout_max_split={3 if carried else 1}",
           f"rl_config.async_engine={str(stepwise).lower()}"]
    return out + (MULTI_TURN if tools else [])


def _doubling_budget():
    """docs/architecture.md's example scheduler, defined where the page puts it."""
    import re

    from mindspeed_rl.trainer.rollout_parts import schedulers

    text = (ROOT / "docs" / "architecture.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text[text.index("### A rollout mode"):], re.S)[0]
    namespace = dict(vars(schedulers))
    exec(code, namespace)  # noqa: S102 - the doc's own example
    return namespace["DoublingBudget"]


def _body(model: str, data: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from mindspeed_rl.algorithms import KLController
    from mindspeed_rl.config import load_config, make_plan
    from mindspeed_rl.rollout import RolloutEngine
    from mindspeed_rl.trainer.context import (BoundFlow, IterationState, PhaseContext, Ranks,
                                              TrainerState)
    from mindspeed_rl.trainer.flow import SampleFlow
    from mindspeed_rl.trainer.phases import rollout
    from mindspeed_rl.trainer.rollout_parts import compose
    from mindspeed_rl.trainer.rollout_parts.composed import CONTINUATIONS, SCHEDULERS, SOURCES
    from mindspeed_rl.trainer.trainer import prompt_datasets
    from mindspeed_rl.transfer_dock import ConsumerLayout, build_transfer_dock

    configs = {c: load_config(CONFIG, _overrides(model, data, *c)) for c in COMBOS}
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = RolloutEngine(model, max_model_len=1120, max_num_seqs=16,
                           gpu_memory_utilization=0.02)
    out = {}
    doubling = _doubling_budget()
    for combo, config in [*configs.items(), ("doubling", configs[(True, False, False)])]:
        plan = make_plan(config, dist.get_world_size())
        one = ConsumerLayout(((0,),))
        flow = SampleFlow(build_transfer_dock("distributed", timeout_s=120),
                          config.features.phases, {"train": one, "gen_writers": one, "gen": one},
                          features=config.features.on)
        roles = type("Roles", (), {"rollout": engine, "agent": None,
                                   "actor": type("Actor", (), {"weight_version": 0})()})()
        train, _ = prompt_datasets(config, tokenizer)
        state = TrainerState(kl_ctrl=KLController(0.0))
        runs = []
        for iteration in (1, 2) if combo == "doubling" or combo[0] else (1,):
            ctx = PhaseContext(config=config, plan=plan, roles=roles, train_data=train,
                               tokenizer=tokenizer, vocab_size=len(tokenizer),
                               ranks=Ranks(0, 1, 0, True), flow=BoundFlow(flow, "rollout"),
                               state=state, it=IterationState(iteration))
            chosen = config.features.rollout
            if combo == "doubling":  # the new part in the shipped loop
                parts = compose(ctx)
                parts.scheduler = doubling.build(chosen)
                budgets = [parts.scheduler.tokens]
                metrics = parts.run()
                budgets.append(parts.scheduler.tokens)
            else:
                metrics = rollout(ctx)
            released = flow.dock.rows(held=False).tolist()
            runs.append({"metrics": metrics, "released": len(released),
                         "budgets": budgets if combo == "doubling" else None,
                         "parts": [SOURCES[chosen.source].__name__,
                                   CONTINUATIONS[chosen.continuation].__name__,
                                   SCHEDULERS[chosen.scheduler].__name__],
                         "lengths": [int(x) for x in flow.dock.tags("length", released)]})
            roles.actor.weight_version += 1
            flow.retire_all()
        if roles.agent is not None:
            roles.agent.close()
        out[combo] = {"runs": runs, "plan": config.features.rollout.describe()}
    engine.shutdown()
    return out


def test_every_composition_logs_its_metric_keys(tmp_path):
    from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
    from mindspeed_rl.models.tiny import make_tiny_hf_dir
    from mindspeed_rl.testing import run_on_ranks

    train, _ = make_arithmetic_problems(64, 1, seed=0, max_operand=20, ops="+")
    write_jsonl(train, tmp_path / "train.jsonl")
    model = make_tiny_hf_dir("qwen2", tmp_path / "qwen2", max_position_embeddings=2048)
    out = run_on_ranks(_body, 1, str(model), str(tmp_path / "train.jsonl"), timeout=900)[0]
    doubling = out.pop("doubling")
    for (carried, tools, stepwise), got in out.items():
        name = f"carried={carried} tools={tools} stepwise={stepwise}"
        expected = set(ROWS) | (set(TOOLS) if tools else set()) | (set(POOL) if carried else set())
        for run in got["runs"]:
            m = run["metrics"]
            assert set(m) == expected, (name, sorted(set(m) ^ expected))
            assert run["released"] == 8, name  # global_batch_size 2 x n 4 whole rows
            assert m["response_length/mean"] == pytest.approx(sum(run["lengths"]) / 8)
            assert m["response_length/max"] == max(run["lengths"]), name
            if tools:  # the scripted parser calls a tool in every turn
                assert m["multi_turn/tool_calls"] > 0 and m["multi_turn/turns"] >= 1, name
                assert m["multi_turn/model_tokens"] + m["multi_turn/tool_tokens"] == \
                    sum(run["lengths"]), name
        # the composed parts are the ones the plan prints
        source, continuation, scheduler = got["runs"][0]["parts"]
        assert source == ("CarriedRows" if carried else "FreshPrompts"), name
        assert continuation == ("ToolTurns" if tools else "SingleTurn"), name
        assert scheduler == ("StepWise" if stepwise and (carried or tools) else
                             "TokenBudget" if carried else "OnePass"), name
        assert ("carried rows" in got["plan"]) == carried and \
            ("tool turns" in got["plan"]) == tools, (name, got["plan"])
    # carried rows: the second iteration trains rows carried from the first (age 1)
    assert any(run["metrics"]["partial_rollout/trained_age_max"] == 1
               for (carried, _, _), got in out.items() if carried for run in got["runs"])
    # the doubling budget: each pass's budget twice the last, through the same source,
    # continuation, loop and metrics
    for run in doubling["runs"]:  # (the second iteration may train groups finished before)
        first, last = run["budgets"]
        passes = run["metrics"]["partial_rollout/passes"]
        assert last == first * 2 ** passes, (run["budgets"], passes)
        assert set(run["metrics"]) == set(ROWS) | set(POOL) and run["released"] == 8
    assert doubling["runs"][0]["metrics"]["partial_rollout/passes"] >= 1
