"""On-policy distillation end to end on CPU: torchrun + pretrain_grpo.py with
``rl_config.adv_estimator: on_policy_distill`` and a teacher_config, megatron + vLLM, 2
ranks, the tiny qwen2 model as the student (PP 2) and another random init of the same
architecture as the teacher (in the actor's layout, offloaded between uses). One launch.

And the dry run's refusals (another tokenizer, a missing path, settings a teacher cannot
run with), each naming its key, before any process group.
"""

from __future__ import annotations

import math

import pytest
from torchrun_jobs import ROOT, run_job, training_rows

from mindspeed_rl.config import main
from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
ITERATIONS = 8
DISTILL = ["rl_config.adv_estimator=on_policy_distill", "rl_config.init_kl_coef=0"]
STUDENT_PP2 = ["actor_config.tensor_model_parallel_size=1",
               "actor_config.pipeline_model_parallel_size=2",
               "generate_config.infer_tensor_parallel_size=2"]
TEACHER_TP2 = ["teacher_config.tensor_model_parallel_size=2",
               "teacher_config.pipeline_model_parallel_size=1"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    train, _ = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "student"),
            # the same architecture and tokenizer, other weights (a sharper distribution)
            "teacher": make_tiny_hf_dir("qwen2", root / "teacher", seed=7,
                                        initializer_range=0.2),
            "data": root / "train.jsonl"}


def _dry_run(assets, *overrides: str) -> int:
    return main(["--config", str(CONFIG), "--dry-run", "--world-size", "2",
                 f"megatron_training.model={assets['model']}",
                 f"megatron_training.data_path={assets['data']}", *STUDENT_PP2, *DISTILL,
                 *overrides])


@pytest.mark.parametrize("overrides, key, words", [
    ([], "teacher_config", "on_policy_distill needs a teacher"),
    (["teacher_config.load=/nonexistent/teacher"], "teacher_config.load", "does not exist"),
    (["teacher:other_tokenizer"], "teacher_config.load", "maps tokens to other ids than the "
                                                         "student's"),
    (["teacher:here", "teacher_config.tensor_model_parallel_size=3"],
     "teacher_config.tensor_model_parallel_size", "do not shard over TP=3"),
    (["teacher:here", "teacher_config.pipeline_model_parallel_size=4"],
     "teacher_config.pipeline_model_parallel_size", "layers"),
    (["teacher:here", "teacher_config.tensor_model_parallel_size=4"],
     "teacher_config.tensor_model_parallel_size", "does not divide the world of 2 ranks"),
    (["teacher:here", "rl_config.filter_groups_enable=true"], "rl_config.filter_groups_enable",
     "task_reward_coef=0"),
    (["teacher:here", "rl_config.adv_estimator=rloo"], "teacher_config",
     "only rl_config.adv_estimator=on_policy_distill reads a teacher"),
])
def test_the_dry_run_refuses_a_teacher_it_cannot_run_naming_the_key(assets, capsys, overrides,
                                                                     key, words):
    if "teacher:other_tokenizer" in overrides:
        other = assets["root"] / "other_tokenizer"
        if not other.exists():
            from mindspeed_rl.models.tiny import build_tokenizer

            make_tiny_hf_dir("qwen2", other, seed=7)
            build_tokenizer(vocab_size=280).save_pretrained(str(other))  # other merges
        overrides = [f"teacher_config.load={other}"]
    overrides = [f"teacher_config.load={assets['teacher']}" if o == "teacher:here" else o
                 for o in overrides]
    capsys.readouterr()  # (the model writer's progress bar)
    assert _dry_run(assets, *overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}") and words in err, err


def test_the_dry_run_shows_the_teacher(assets, capsys):
    assert _dry_run(assets, f"teacher_config.load={assets['teacher']}", *TEACHER_TP2) == 0
    out = capsys.readouterr().out
    assert (f"teacher    teacher_config.load={assets['teacher']} (qwen2, 2 layers, hidden 128; "
            "TP=2 PP=1, its own layout, DP=1; on host when idle)") in out
    assert "distillation teacher (fp32, TP=2 PP=1; on host when idle)" in out
    assert "teacher phase (actor training state + teacher)" in out
    assert "advantages: on_policy_distill (pretrain_grpo.py)" in out


@pytest.mark.slow
def test_the_student_moves_toward_the_teacher_over_every_phase(assets):
    proc, rows = run_job(
        assets, "run", f"megatron_training.train_iters={ITERATIONS}", *STUDENT_PP2, *DISTILL,
        f"teacher_config.load={assets['teacher']}", *TEACHER_TP2, "actor_config.lr=2e-3",
        "rl_config.mini_batch_size=2", "rl_config.entropy_coeff=0",
        launcher="pretrain_grpo.py", config=CONFIG, nproc=2)
    train = training_rows(rows)
    assert sorted(train) == list(range(1, ITERATIONS + 1))
    for it, row in train.items():
        for phase in ("rollout", "resharding_to_infer", "resharding_to_train", "reward",
                      "old_log_p", "teacher_model", "distill_adv", "update"):
            assert row[f"timing/{phase}"] > 0, (it, phase)
        assert "timing/adv" not in row and "timing/reference_model" not in row
        for key in ("distill/reverse_kl", "distill/student_logprob", "distill/teacher_logprob",
                    "distill/reverse_kl_pos_0_16", "reward/mean", "actor/pg_loss"):
            assert math.isfinite(row[key]), (it, key, row[key])
        assert row["distill/teacher_logprob"] < 0 and row["distill/student_logprob"] < 0
    kl = [train[i]["distill/reverse_kl"] for i in sorted(train)]
    print("reverse KL per iteration:", kl)
    assert kl[0] > 0.05  # two different models: the student starts far from the teacher
    # and moves toward it (16 responses an iteration: compare pairs of iterations)
    assert sum(kl[-2:]) < 0.7 * sum(kl[:2]), kl
    assert f"iter {ITERATIONS}/{ITERATIONS}" in proc.stdout + proc.stderr


def test_the_teacher_section_is_read_from_the_file_and_the_recipe_loads(assets, capsys):
    import yaml

    from mindspeed_rl.config import load_config

    job = yaml.safe_load(CONFIG.read_text())
    job["teacher_config"] = {"load": str(assets["teacher"]), "tensor_model_parallel_size": 2,
                             "pipeline_model_parallel_size": 1}
    path = assets["root"] / "job_with_teacher.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["--config", str(path), "--dry-run", "--world-size", "2",
                 f"megatron_training.model={assets['model']}", *STUDENT_PP2, *DISTILL]) == 0
    assert "TP=2 PP=1, its own layout, DP=1" in capsys.readouterr().out
    recipe = load_config(ROOT / "configs" / "distill_smollm2_demo.yaml",
                         [f"megatron_training.model={assets['model']}",
                          f"teacher_config.load={assets['teacher']}"], check_data=False)
    assert recipe.rl_config.adv_estimator == "on_policy_distill"
    assert recipe.rl_config.init_kl_coef == 0 and recipe.teacher_config.task_reward_coef == 0
