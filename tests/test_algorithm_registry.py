"""The algorithm registry: families and estimators declared once, and the config, the
dry run and the recipes read from it (pure Python, no process group)."""

from __future__ import annotations

import pytest

from mindspeed_rl.algorithms import registry
from mindspeed_rl.config import load_config, main
from mindspeed_rl.trainer import recipes
from test_config import REPO, error_of, job  # noqa: F401 (job: the fixture; tests/ on sys.path)

GRPO_ESTIMATORS = ["group_norm"]


def test_the_registry_holds_each_family_and_its_estimators():
    assert [a.name for a in registry.algorithms()] == ["grpo", "ppo"]
    assert [e.name for e in registry.estimators("grpo")] == GRPO_ESTIMATORS
    assert [e.name for e in registry.estimators("ppo")] == ["gae"]
    assert registry.estimator("grpo").name == "group_norm"   # verl's name, same estimator
    assert registry.estimator("nope") is None
    assert registry.algorithm_of_stage("ray_dapo").launcher == "pretrain_grpo.py"
    assert registry.stages() == ["ray_dapo", "ray_grpo", "ray_ppo"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.estimator("group_norm"))


def test_each_family_runs_its_own_advantage_phase():
    grpo, ppo = registry.phases("grpo", "group_norm"), registry.phases("ppo", "gae")
    assert "adv" in grpo and "gae" not in grpo and "gae" in ppo and "adv" not in ppo
    assert recipes.ALGORITHMS["grpo"] == grpo and recipes.ALGORITHMS["ppo"] == ppo
    assert set(recipes.recipes()) == {"grpo/group_norm", "ppo/gae"}


@pytest.mark.parametrize("written, resolved", [
    (None, "group_norm"), ("grpo", "group_norm"), ("group_norm", "group_norm")])
def test_adv_estimator_selects_within_the_launcher(job, written, resolved):
    overrides = [] if written is None else [f"rl_config.adv_estimator={written}"]
    config = load_config(job(), overrides, check_data=False)
    assert config.rl_config.adv_estimator == resolved


@pytest.mark.parametrize("override, algorithm, expected", [
    ("rl_config.adv_estimator=rlooo", "grpo",
     "is not an advantage estimator: pretrain_grpo.py runs "
     "GRPO, whose estimator is group_norm; use one of ['group_norm'] (or leave it out)"),
    ("rl_config.adv_estimator=gae", "grpo",
     "gae needs a critic, which pretrain_grpo.py does not build"),
    ("rl_config.adv_estimator=group_norm", "ppo", "launch pretrain_grpo.py for group_norm, or "
                                                  "use one of ['gae']"),
])
def test_bad_adv_estimator_names_the_key_and_the_choices(job, override, algorithm, expected):
    sections = {"critic_config": {"lr": 1e-5}} if algorithm == "ppo" else {}
    message = error_of(load_config, job(**sections), [override], check_data=False,
                       algorithm=algorithm)
    assert message.startswith("rl_config.adv_estimator=") and expected in message


def test_the_dry_run_refuses_an_unknown_estimator_before_any_process_group(job, capsys):
    path = job()
    assert main(["--config", str(path), "--dry-run", "--world-size", "4",
                 "rl_config.adv_estimator=reinforce"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rl_config.adv_estimator='reinforce'") and "'group_norm'" in err
    assert main(["--config", str(path), "--dry-run", "--world-size", "4",
                 "rl_config.adv_estimator=grpo"]) == 0
    assert "advantages: group_norm (pretrain_grpo.py)" in capsys.readouterr().out


def test_an_estimator_without_the_kl_in_its_reward_refuses_use_kl_in_reward(job):
    message = error_of(load_config, job(), ["rl_config.use_kl_in_reward=true"],
                       check_data=False)
    assert message.startswith("rl_config.use_kl_in_reward=true: GRPO with adv_estimator "
                              "group_norm puts the KL into the loss (init_kl_coef)")
