"""docs/trainer.md's worked example: a new phase is one function and one line in PHASES.

The test takes the two code blocks of the example from the doc, adds the phase as the doc
says, and checks that GRPO and PPO run it where the line puts it, that the column
contract still holds, and that the function runs on a phase context (2 gloo ranks).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

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


def test_one_line_puts_the_phase_into_every_algorithm_that_runs_it():
    _, line = _example()
    namespace = {"Phase": recipes.Phase, "_BOTH": recipes._BOTH,
                 "p": type("phases", (), {"peak_memory": staticmethod(_phase_function())})}
    phase = eval(line, namespace)  # noqa: S307 - the doc's own example
    phases = {}
    for name, existing in recipes.PHASES.items():
        phases[name] = existing
        if name == recipes.UPDATE:  # "placed after the UPDATE line"
            phases[phase.name] = phase
    algorithms = recipes.algorithms_of(phases)
    assert algorithms["grpo"][-2:] == ("update", "peak_memory")
    assert algorithms["ppo"][-2:] == ("update", "peak_memory")
    assert {a: [n for n in names if n != "peak_memory"] for a, names in algorithms.items()} \
        == {a: list(names) for a, names in recipes.ALGORITHMS.items()}
    check_contract(algorithms)


def _run_example():
    ctx = PhaseContext(config=None, plan=None, roles=None, train_data=None, tokenizer=None,
                       vocab_size=0, ranks=None, flow=None, state=None, it=None,
                       reward_pool=None)
    return _phase_function()(ctx)


def test_the_example_phase_runs_and_reports_a_metric():
    results = run_on_ranks(_run_example, 2, timeout=120)
    assert results[0] == results[1]  # reduced over the ranks
    assert 0.01 < results[0]["memory/peak_rss_gib"] < 64
