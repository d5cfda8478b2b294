"""docs/algorithms.md's worked example: a new estimator is one module, registered by its
decorator when imported.

The test takes the module and the import line from the doc, runs the module as the
import would (its decorator registers the estimator), and checks that pretrain_grpo.py's
config accepts it (and refuses a group of one), that the dry run names it, that the
recipe runs it in the adv phase, and that it gives the known answer through the one call
signature every estimator has (GRPO without the std division). Pure Python: no process
group.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from mindspeed_rl.algorithms import registry
from mindspeed_rl.algorithms.estimator import AdvantageInputs, local_sums
from mindspeed_rl.algorithms.grpo import group_norm
from mindspeed_rl.config import load_config, main
from mindspeed_rl.trainer import recipes
from test_config import error_of, job  # noqa: F401 (job: the fixture; tests/ on sys.path)

DOC = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"


@pytest.fixture
def dr_grpo():
    text = DOC.read_text()
    section = text[text.index("#### Adding an estimator: a worked example"):]
    module_text, line = re.findall(r"```python\n(.*?)```", section, re.S)[:2]
    assert line.strip().startswith("from mindspeed_rl.algorithms import") and \
        line.strip().endswith(", dr_grpo")  # the package's import line, with the new module
    assert registry.estimator("dr_grpo") is None
    module = types.ModuleType("mindspeed_rl.algorithms.dr_grpo")
    exec(module_text, module.__dict__)  # noqa: S102 - the doc's own example, as imported
    try:
        yield module
    finally:
        registry.unregister("dr_grpo")


def test_the_example_estimator_runs_under_pretrain_grpo(dr_grpo, job, capsys):
    path = job()
    config = load_config(path, ["rl_config.adv_estimator=dr_grpo"], check_data=False)
    assert config.rl_config.adv_estimator == "dr_grpo"
    assert "dr_grpo" in [e.name for e in registry.estimators("grpo")]
    assert registry.phases("grpo", "dr_grpo") == recipes.recipes()["grpo/group_norm"]  # the adv phase
    assert main(["--config", str(path), "--dry-run", "--world-size", "4",
                 "rl_config.adv_estimator=dr_grpo"]) == 0
    assert "advantages: dr_grpo (pretrain_grpo.py): A_i = r_i - mean_g" in capsys.readouterr().out
    assert "a group needs at least 2" in error_of(
        load_config, path, ["rl_config.adv_estimator=dr_grpo", "rl_config.n_samples_per_prompt=1",
                            "generate_config.sampling_config.temperature=0"], check_data=False)
    assert "launch pretrain_grpo.py for dr_grpo" in error_of(
        load_config, job(critic_config={"lr": 1e-5}), ["rl_config.adv_estimator=dr_grpo"],
        check_data=False, algorithm="ppo")


def test_the_example_formula_is_grpo_without_the_std(dr_grpo):
    scores = torch.tensor([[1.0, 0.0, 0.2, 1.0], [0.5, 0.5, 0.5, 0.5]])
    lengths = torch.tensor([3, 1, 2, 2, 1, 3, 3, 2])
    mask = (torch.arange(3)[None, :] < lengths[:, None]).float()
    x = AdvantageInputs(rewards=scores.reshape(-1), response_mask=mask, loss_mask=mask,
                        group_size=4)
    got = registry.estimator("dr_grpo").fn(x, local_sums).advantages
    torch.testing.assert_close(got, group_norm(x, local_sums,
                                               norm_adv_by_std_in_grpo=False).advantages)
    # by hand, the first group's mean is 0.55: its first response's tokens get 0.45
    torch.testing.assert_close(got[0], torch.tensor([0.45, 0.45, 0.45]))
