"""docs/trainer.md's worked example: a new phase is one function, one line in PHASES and
its name in the phase lists of the families that run it.

The test takes the two code blocks of the example from the doc, adds the phase as the doc
says, and checks that GRPO and PPO run it where their lists put it, that the column
contract still holds, and that the function runs on a phase context (2 gloo ranks).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms import registry
from mindspeed_rl.testing import run_on_ranks
from mindspeed_rl.trainer import recipes
from mindspeed_rl.trainer.columns import check_contract
from mindspeed_rl.trainer.context import PhaseContext

DOC = Path(__file__).resolve().parents[1] / "docs" / "trainer.md"


def _example() -> tuple[str, str]:
    text = DOC.read_text()
    section = text[text.index("#### Adding a phase: a worked example"):]
    function, line = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    return function, line.strip().rstrip(",")


def _phase_function():
    namespace = {"torch": torch, "dist": dist, "PhaseContext": PhaseContext}
    function, _ = _example()
    exec(function, namespace)  # noqa: S102 - the doc's own example
    return namespace["peak_memory"]


def test_one_line_and_the_family_lists_put_the_phase_where_they_say():
    _, line = _example()
    namespace = {"Phase": recipes.Phase,
                 "p": type("phases", (), {"peak_memory": staticmethod(_phase_function())})}
    phase = eval(line, namespace)  # noqa: S307 - the doc's own example
    assert phase.name == "peak_memory" and not phase.generation
    before = recipes.recipes()
    families = registry.algorithms()
    try:  # "peak_memory" after p.UPDATE in the phases of GRPO and PPO
        for family in families:
            registry.unregister(family.name)
        for family in families:  # DPO keeps its own list
            extra = (phase.name,) if family.name in ("grpo", "ppo") else ()
            registry.register(dataclasses.replace(family, phases=family.phases + extra))
        after = recipes.recipes()
    finally:
        for family in registry.algorithms():
            registry.unregister(family.name)
        for family in families:
            registry.register(family)
    rl = {k: names for k, names in after.items() if k.startswith(("grpo/", "ppo/"))}
    assert set(after) == set(before) and all(names[-2:] == ("update", "peak_memory")
                                             for names in rl.values())
    assert {k: names[:-1] for k, names in rl.items()} == {k: before[k] for k in rl}
    assert after["dpo"] == before["dpo"]
    check_contract(after)


def _run_example():
    ctx = PhaseContext(config=None, plan=None, roles=None, train_data=None, tokenizer=None,
                       vocab_size=0, ranks=None, flow=None, state=None, it=None,
                       reward_pool=None)
    return _phase_function()(ctx)


def test_the_example_phase_runs_and_reports_a_metric():
    results = run_on_ranks(_run_example, 2, timeout=120)
    assert results[0] == results[1]  # reduced over the ranks
    assert 0.01 < results[0]["memory/peak_rss_gib"] < 64
