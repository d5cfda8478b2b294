"""The benchmark scripts run and print their JSON (numbers are never asserted: they are
measurements); what they replay is checked against the trainer's own declarations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_transfer_dock import ALGORITHMS  # noqa: E402  (the recipes the benchmark replays)


# one algorithm per distinct phase list: the benchmark replays phases, not estimators
# (grpo/rloo runs grpo's phases; grpo/reinforce_plus_plus has a phase of its own)
FLOWS = sorted({phases: name for name, phases in sorted(ALGORITHMS.items(), reverse=True)}.values())


@pytest.mark.parametrize("algorithm", FLOWS)
def test_bench_transfer_dock_replays_the_declared_flow(algorithm):
    """Every distinct phase list through the TransferDock; the centralized baseline (the same
    replay through one rank's store, which does not depend on the flow) once, with GRPO's."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "bench_transfer_dock.py"), "--algorithm", algorithm,
           "--rows", "32", "--n-samples-per-prompt", "4", "--mean-len", "16", "--max-len", "64",
           "--tp", "1", "--iterations", "2", "--reward-model"]
    for mode in ("distributed", "centralized") if algorithm == "grpo" else ("distributed",):
        proc = subprocess.run(cmd + ["--mode", mode], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        expected = [p for p in ALGORITHMS[algorithm] if not p.startswith("resharding")]
        assert result["phases"] == expected and result["mode"] == mode
        assert result["row_bytes_rank0_own_share"] > 0 and result["seconds_per_iteration"] > 0


def test_long_tail_repeats_report_each_ns_medians():
    """--repeats: an N's numbers are the medians of its runs, the seconds of each kept."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_long_tail import _medians, _parse

    runs = [{"rollout_s_per_iteration": s, "iteration_s": 2 * s, "cpu_steal_fraction": f,
             "decode_steps_per_iteration": 10} for s, f in ((3.0, 0.2), (1.0, None), (2.0, 0.0))]
    out = _medians(runs)
    assert (out["rollout_s_per_iteration"], out["iteration_s"]) == (2.0, 4.0)
    assert out["cpu_steal_fraction"] is None and out["decode_steps_per_iteration"] == 10
    assert out["rollout_s_per_iteration_each"] == [3.0, 1.0, 2.0]
    assert "rollout_s_per_iteration_each" not in _medians(runs[:1])
    for bad in (["--repeats", "0"], ["--iterations", "0"]):
        with pytest.raises(SystemExit):
            _parse(bad)


def test_long_tail_workload_is_heavy_tailed_and_runs_side_by_side():
    """bench_long_tail.py's drawn lengths have p99 / median >= 8 (the issue's bar), and a
    short run of N = 1 and N = 2 prints its JSON with both runs and their ratio."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_long_tail import drawn_length

    lengths = sorted(drawn_length((i, i + 1), 12.0, 1.2, 192) for i in range(2000))
    assert lengths[int(0.99 * len(lengths))] / lengths[len(lengths) // 2] >= 8
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_long_tail.py"),
                           "--splits", "1", "2", "--iterations", "1", "--warmup", "0",
                           "--groups", "4", "--max-tokens", "48", "--median", "8"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["runs"]) == {"1", "2"} and set(result["ratios_vs_1"]) == {"2"}
    for run in result["runs"].values():
        assert run["rollout_s_per_iteration"] > 0 and 0 < run["decode_occupancy"] <= 1
        # every N trains global_batch_size groups of n = 4 responses of at least one token
        assert run["trained_tokens_per_iteration"] >= 4 * 4
        assert run["cpu_steal_fraction"] is None or 0 <= run["cpu_steal_fraction"] <= 1
    # N = 1 runs one generate call per iteration: its steps are its longest response
    assert 0 < result["runs"]["1"]["decode_steps_per_iteration"] <= 48


def test_decode_step_cost_is_measured_per_batch_and_fitted():
    """bench_decode_step.py times decode steps with the prefill taken out, per context and
    batch size, and fits a line ms(B) = a + b * B through them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_decode_step import _parse, fit_line

    assert fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((1.0, 2.0))
    assert fit_line([8.0], [5.0]) == (5.0, 0.0)
    for bad in (["--steps", "0"], ["--repeats", "0"], ["--batch-sizes", "0", "4"]):
        with pytest.raises(SystemExit):
            _parse(bad)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"),
                           "--batch-sizes", "1", "4", "--contexts", "8", "24", "--steps", "16",
                           "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["ms_per_step"]) == set(result["fit"]) == {"8", "24"}
    for context, per_batch in result["ms_per_step"].items():
        assert set(per_batch) == {"1", "4"} and min(per_batch.values()) > 0
        a, b = fit_line([1.0, 4.0], [per_batch["1"], per_batch["4"]])
        fit = result["fit"][context]
        assert fit["ms_per_step"] == pytest.approx(a)
        assert fit["us_per_sequence"] == pytest.approx(1000 * b)
        assert fit["batch_independent_share"] == pytest.approx(a / per_batch["4"])


def test_bench_tools_times_both_modes():
    """bench_tools.py: median and p99 per call of each program, in the sandbox and without,
    and the sandbox's added median."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_tools import PROGRAMS, percentile

    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.99) == \
        pytest.approx(1.99)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tools.py"),
                           "--calls", "2", "--warmup", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for program in PROGRAMS:
        modes = ["sandbox", "no_sandbox"] + (["no_sandbox_bare"] if program == "trivial" else [])
        for mode in modes:
            row = result[program][mode]
            assert row["calls"] == 2 and 0 < row["median_s"] <= row["p99_s"]
        assert all(f"added_median_ms_vs_{mode}" in result[program] for mode in modes[1:])


def test_bench_grpo_puts_each_phase_over_its_own_compute_floor(tmp_path):
    """times_compute_floor: a phase's seconds over its FLOPs at the peak of all ranks, the
    iteration's over all its FLOPs (what issue-level speed goals are stated in). The demo's
    batch and layout with a tiny model (a fresh clone has no cache/)."""
    from argparse import Namespace

    from bench_grpo import iteration_flops, summarize

    from mindspeed_rl.config import load_config, make_plan
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    make_tiny_hf_dir("llama", tmp_path / "llama")
    config = load_config(str(ROOT / "configs" / "grpo_smollm2_demo.yaml"),
                         [f"megatron_training.model={tmp_path / 'llama'}",
                          "actor_config.num_layer_list=null"], check_data=False)
    plan = make_plan(config, 2)
    timed = [{"timing/all": 40.0 + i, "timing/update": 20.0 + i, "timing/reference_model": 7.0,
              "timing/rollout": 8.0, "prompt_length/mean": 39.0, "response_length/mean": 24.0,
              "timing/resharding_to_infer": 2.0 + i, "perf/resharding_to_infer_floor_s": 0.25,
              "perf/rollout_floor_s": 4.0 - i} for i in range(3)]
    out = summarize(Namespace(iterations=3, warmup=1), config, plan, timed, on_policy=True,
                    with_ref=True, world=2, matmul_peak=50.0, threads=1, device="cpu")
    flops = iteration_flops(config.model, prompt_len=39.0, response_len=24.0, num_prompts=8,
                            n_samples=8, epochs=1, with_ref=True, with_old=False)
    at_peak = 50.0e9 * 2
    ratios = out["times_compute_floor"]
    assert ratios["timing/update"] == round(21.0 / (flops["train"] / at_peak), 3)
    assert ratios["timing/reference_model"] == round(7.0 / (flops["ref"] / at_peak), 3)
    assert ratios["timing/rollout"] == round(8.0 / (flops["rollout"] / at_peak), 3)
    assert ratios["timing/all"] == round(41.0 / (sum(flops.values()) / at_peak), 3)
    assert ratios["timing/old_log_p"] is None  # on-policy: no such phase
    assert out["compute_floor_s"] == round(sum(flops.values()) / at_peak, 3)
    # the floors the trainer logs: rollout 8/4, 8/3, 8/2; resharding 2/.25, 3/.25, 4/.25
    assert out["times_trainer_floor"] == {"timing/rollout": round(8 / 3, 3),
                                          "timing/resharding_to_infer": 12.0,
                                          "timing/resharding_to_train": None}
    assert out["floors_s"]["perf/resharding_to_infer_floor_s"] == 0.25


FAKE_BENCH = '''import argparse, json, os, pathlib
p = argparse.ArgumentParser()
p.add_argument("--log-dir")
p.add_argument("--speed")
args = p.parse_args()
assert os.path.isdir(args.log_dir)
seconds = float(pathlib.Path(__file__).with_name("seconds.txt").read_text())
print(json.dumps({"timing/all": seconds * float(args.speed), "model": "m", "ok": True,
                  "world": int(os.environ.get("WORLD_SIZE", 0)),
                  "times_compute_floor": {"timing/all": seconds / 2}}))
'''


def test_against_runs_both_commits_alternating_and_prints_their_ratio(tmp_path):
    """bench_grpo.py --against REV's driver with a git history of its own: REV's script is
    REV's (a worktree), each side runs under torchrun from the caller's directory with the
    same arguments, the order alternates, and the ratio is this / REV."""
    from against import side_by_side

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "bench.py").write_text(FAKE_BENCH)
    seconds = repo / "benchmarks" / "seconds.txt"

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                       check=True, capture_output=True)
    git("init", "-q")
    seconds.write_text("4.0")
    git("add", ".")
    git("commit", "-qm", "slow")
    seconds.write_text("3.0")
    git("commit", "-qam", "fast")
    out = side_by_side("HEAD~1", "benchmarks/bench.py", ["--speed", "2"], rounds=1, nproc=1,
                       repo=repo)
    assert out["order"] == [["this", "against"]]
    assert out["timing/all_per_round"] == {"this": [6.0], "against": [8.0]}
    assert out["ratio"] == {"timing/all": 0.75}
    assert out["this_side"]["times_compute_floor/timing/all"] == 1.5
    assert out["this_side"]["world"] == out["against_side"]["world"] == 1  # under torchrun
    assert "model" not in out["this_side"] and "ok" not in out["this_side"]
    assert out["against"] == subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=repo, text=True,
                                            capture_output=True).stdout.strip()
    assert not out["this"].endswith("uncommitted changes")
    # the worktree and the logs are gone, the repository is as it was
    assert "bench_against_" not in subprocess.run(["git", "worktree", "list"], cwd=repo,
                                                  text=True, capture_output=True).stdout
    # the order alternates round by round (a runner without torchrun: the order only)
    seen = []

    def plain(tree, script, args, nproc, log):
        seen.append(tree == repo)
        return json.loads(subprocess.run([sys.executable, str(tree / script), *args],
                                         capture_output=True, text=True).stdout)
    out = side_by_side("HEAD~1", "benchmarks/bench.py", ["--speed", "1"], rounds=3, nproc=1,
                       run=plain, repo=repo)
    assert seen == [True, False, False, True, True, False]
    assert out["order"] == [["this", "against"], ["against", "this"], ["this", "against"]]
    with pytest.raises(SystemExit, match="--against nope: not a commit of"):
        side_by_side("nope", "benchmarks/bench.py", [], rounds=1, nproc=1, repo=repo)
    # --own-config: each side reads the config from its own tree
    configs = []

    def recorded(tree, script, args, nproc, log):
        configs.append(args[args.index("--config") + 1])
        return {"timing/all": 1.0}
    side_by_side("HEAD~1", "benchmarks/bench.py", ["--config", "configs/demo.yaml", "x=1"],
                 rounds=2, nproc=1, run=recorded, repo=repo, own_config="configs/demo.yaml")
    assert configs[0] == str(repo / "configs/demo.yaml")
    assert configs[1].endswith("/tree/configs/demo.yaml") and configs[1] == configs[2]
    from against import own_config_path

    assert own_config_path(str(repo / "configs" / "demo.yaml"), repo) == "configs/demo.yaml"
    with pytest.raises(SystemExit, match="--own-config: /elsewhere.yaml is not a file of"):
        own_config_path("/elsewhere.yaml", repo)


def test_tune_layout_times_only_the_layouts_the_plan_accepts_and_memory_fits(tmp_path, capsys):
    """tools/tune_layout.py's candidates at 2 ranks: a model of 3 heads refuses TP 2 (the dry
    run's reason is given); a memory limit below the plan skips the rest, and with nothing
    left it stops before launching anything."""
    sys.path.insert(0, str(ROOT / "tools"))
    from tune_layout import candidates, main

    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    model = make_tiny_hf_dir("llama", tmp_path / "llama", num_attention_heads=3,
                             num_key_value_heads=1, hidden_size=96)
    demo = [str(ROOT / "configs" / "grpo_smollm2_demo.yaml"), [f"megatron_training.model={model}"]]
    found = {name: (plan is not None, why) for name, _, plan, why in
             candidates(*demo, 2, 2 ** 40)}
    assert list(found) == ["TP1 PP1 DP2", "TP1 PP2 DP1", "TP2 PP1 DP1"]
    assert found["TP1 PP1 DP2"] == found["TP1 PP2 DP1"] == (True, "")
    assert found["TP2 PP1 DP1"][0] is False
    assert "does not divide the model's num_attention_heads=3" in found["TP2 PP1 DP1"][1]
    assert main(["--config", demo[0], "--world-size", "2", "--memory-gib", "0.001",
                 *demo[1]]) == 2
    err = capsys.readouterr().err
    assert "TP1 PP2 DP1: skipped: needs" in err and "over --memory-gib 0.0" in err
    assert "tune_layout: error: no layout of this world size fits" in err


def test_tune_layout_tries_pipeline_splits_that_lighten_the_last_stage(tmp_path):
    """--shift N adds the layer splits that move 1 .. N layers off the last stage (it alone
    runs the vocabulary projection); each becomes a num_layer_list the dry run accepts."""
    sys.path.insert(0, str(ROOT / "tools"))
    from tune_layout import candidates, stage_splits

    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    assert stage_splits(30, 2, 2) == [None, "16,14", "17,13"]
    assert stage_splits(30, 1, 2) == [None]
    assert stage_splits(7, 3, 2) == ["3,2,2", "4,2,1"]  # the last stage keeps a layer
    assert stage_splits(8, 4, 3) == [None, "3,2,2,1"]
    model = make_tiny_hf_dir("llama", tmp_path / "llama", num_hidden_layers=4,
                             num_attention_heads=3, num_key_value_heads=1, hidden_size=96)
    found = {name: (layout, plan is not None) for name, layout, plan, _ in candidates(
        str(ROOT / "configs" / "grpo_smollm2_demo.yaml"), [f"megatron_training.model={model}"],
        2, 2 ** 40, shift=2)}
    assert list(found) == ["TP1 PP1 DP2", "TP1 PP2 DP1", "TP1 PP2 DP1 [3,1]", "TP2 PP1 DP1"]
    layout, accepted = found["TP1 PP2 DP1 [3,1]"]
    assert accepted and "actor_config.num_layer_list=3,1" in layout
    assert "actor_config.num_layer_list=null" in found["TP1 PP2 DP1"][0]


def test_compare_suite_time_balances_the_modules_and_refuses_a_non_clone(tmp_path):
    """tools/compare_suite_time.py: the heaviest module first, each to the lightest group;
    a module of one clone only is still placed (it runs where it exists)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from compare_suite_time import chunks, main

    groups = chunks({"a", "b", "c", "d", "new"}, {"a": 100, "b": 60, "c": 50, "d": 10}, 2)
    assert groups == [["a", "new"], ["b", "c", "d"]]  # an unknown module weighs 30 s
    with pytest.raises(SystemExit):
        main([str(tmp_path), str(ROOT)])
