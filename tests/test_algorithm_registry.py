"""The algorithm registry: families and estimators declared once, and the config, the
dry run and the recipes read from it (pure Python, no process group)."""

from __future__ import annotations

import pytest

from mindspeed_rl.algorithms import registry
from mindspeed_rl.config import load_config, main
from mindspeed_rl.trainer import recipes
from test_config import REPO, error_of, job  # noqa: F401 (job: the fixture; tests/ on sys.path)

GRPO_ESTIMATORS = ["group_norm", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                   "on_policy_distill"]


def test_the_registry_holds_each_family_and_its_estimators():
    assert [a.name for a in registry.algorithms()] == ["grpo", "ppo", "dpo"]
    assert [e.name for e in registry.estimators("grpo")] == GRPO_ESTIMATORS
    assert [e.name for e in registry.estimators("ppo")] == ["gae"]
    assert registry.estimator("grpo").name == "group_norm"   # verl's name, same estimator
    assert registry.estimator("nope") is None
    assert registry.algorithm_of_stage("ray_dapo").launcher == "pretrain_grpo.py"
    assert registry.stages() == ["dpo", "ray_dapo", "ray_grpo", "ray_ppo"]
    assert registry.estimators("dpo") == () and registry.algorithm("dpo").default_estimator is None
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.estimator("rloo"))


def test_each_estimator_runs_its_own_advantage_phase():
    grpo = registry.phases("grpo", "group_norm")
    assert grpo == registry.phases("grpo", "rloo") == registry.phases(
        "grpo", "reinforce_plus_plus_baseline")
    assert "adv" in grpo and "discounted_returns" not in grpo
    rpp = registry.phases("grpo", "reinforce_plus_plus")
    assert "adv" not in rpp  # after the forwards: the KL in its reward reads their log-probs
    assert rpp.index("discounted_returns") == rpp.index("reference_model") + 1
    assert recipes.recipes()["grpo/group_norm"] == grpo
    assert set(recipes.recipes()) == {*(f"grpo/{e}" for e in GRPO_ESTIMATORS), "ppo/gae", "dpo"}
    # a family without advantages runs its own phases, none of the estimators'
    assert recipes.recipes()["dpo"] == ("pairs", "reference_model", "preference_update")


@pytest.mark.parametrize("written, resolved", [
    (None, "group_norm"), ("grpo", "group_norm"), ("rloo", "rloo"),
    ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline")])
def test_adv_estimator_selects_within_the_launcher(job, written, resolved):
    overrides = [] if written is None else [f"rl_config.adv_estimator={written}"]
    config = load_config(job(), overrides, check_data=False)
    assert config.rl_config.adv_estimator == resolved


@pytest.mark.parametrize("override, algorithm, expected", [
    ("rl_config.adv_estimator=rlooo", "grpo",
     "is not an advantage estimator: pretrain_grpo.py runs "
     "GRPO, whose estimator is group_norm (or rloo, reinforce_plus_plus, "
     "reinforce_plus_plus_baseline, on_policy_distill); use one of ['group_norm', 'rloo', "
     "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'on_policy_distill'] (or leave "
     "it out)"),
    ("rl_config.adv_estimator=gae", "grpo",
     "gae needs a critic, which pretrain_grpo.py does not build"),
    ("rl_config.adv_estimator=rloo", "ppo", "launch pretrain_grpo.py for rloo, or use one of "
                                            "['gae']"),
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
    assert err.startswith("error: rl_config.adv_estimator='reinforce'") and "'rloo'" in err
    assert main(["--config", str(path), "--dry-run", "--world-size", "4",
                 "rl_config.adv_estimator=rloo"]) == 0
    assert "advantages: rloo (pretrain_grpo.py)" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, expected", [
    (["rl_config.adv_estimator=rloo", "rl_config.n_samples_per_prompt=1",
      "generate_config.sampling_config.temperature=0"],
     "rl_config.n_samples_per_prompt=1: rloo advantages compare the responses of one prompt, "
     "so a group needs at least 2"),
    (["rl_config.adv_estimator=rloo", "rl_config.use_kl_in_reward=true"],
     "GRPO with adv_estimator rloo puts the KL into the loss (init_kl_coef); set "
     "use_kl_in_reward: false, or adv_estimator: one of ['reinforce_plus_plus']"),
    (["rl_config.adv_estimator=reinforce_plus_plus", "rl_config.gamma=1.5"],
     "rl_config.gamma=1.5: must lie in [0, 1]"),
])
def test_estimator_checks_name_the_key(job, overrides, expected):
    assert expected in error_of(load_config, job(), overrides, check_data=False)


def test_reinforce_plus_plus_takes_the_kl_into_its_reward(job):
    config = load_config(job(), ["rl_config.adv_estimator=reinforce_plus_plus",
                                 "rl_config.use_kl_in_reward=true"], check_data=False)
    assert config.rl_config.use_kl_in_reward
