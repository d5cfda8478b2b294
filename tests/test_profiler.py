"""``profiler_config.integrated``: MindSpeed-RL's profiler keys on torch's profiler.

The config side (the section as MindSpeed-RL writes it, its stages in this job's phases,
the errors) and the recorder (mindspeed_rl/metrics/profiler.py) driven by real phase timers
around real operators. The end-to-end run (a launch profiling two phases on rank 0) rides on
tests/test_grpo_e2e.py's TP 2 layout run.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torchrun_jobs import ROOT

from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.config.plan import make_plan
from mindspeed_rl.config.profiling import profiled_phases
from mindspeed_rl.metrics import Timers
from mindspeed_rl.metrics.profiler import PhaseProfiler
from mindspeed_rl.metrics.timers import add_phase_observer, remove_phase_observer

CONFIG = ROOT / "configs" / "grpo_qwen25_7b.yaml"
PPO = ROOT / "configs" / "ppo_qwen25_7b.yaml"
KEY = "profiler_config.integrated"


def written(tmp_path, body: dict, config=CONFIG):
    """The config file with MindSpeed-RL's nested ``profiler_config`` section added."""
    raw = yaml.safe_load(config.read_text())
    raw["profiler_config"] = {"integrated": body}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def load(path, *overrides, algorithm="grpo"):
    return load_config(path, overrides, algorithm=algorithm, check_data=False)


def test_mindspeed_rls_section_loads_with_its_stages_mapped_to_phases(tmp_path):
    # the keys of MindSpeed-RL's own system-test config (tests/st/configs/...integrated.yaml)
    path = written(tmp_path, {
        "profile": True, "mstx": False, "stage": "actor_update",
        "profile_save_path": "./profiler_data", "profile_export_type": "db",
        "profile_step_start": 1, "profile_step_end": 2, "profile_level": "level1",
        "profile_with_memory": False, "profile_record_shapes": False, "profile_with_cpu": True,
        "profile_with_npu": True, "profile_with_module": False, "profile_analysis": True,
        "profile_ranks": [0]})
    config = load(path)
    s = config.profiler_config.integrated
    assert s.profile and s.profile_ranks == (0,) and s.profile_analysis
    assert s.profile_save_path == str(tmp_path.cwd() / "profiler_data")  # resolved at load
    assert profiled_phases(config) == {"update": "actor_update"}
    notices = "\n".join(config.notices)
    assert f"{KEY}.profile_export_type=db: torch_npu's database export" in notices
    assert f"{KEY}.profile_level=level1: torch_npu's collection level" in notices
    text = make_plan(config, 8).format()
    assert ("profiler: torch.profiler, phases update, iteration 1 of this launch, ranks 0 -> "
            + str(tmp_path.cwd() / "profiler_data")) in text
    # a list of stages, MindSpeed-RL's names and this project's phase names mixed
    config = load(path, f"{KEY}.stage=[actor_generate,resharding_to_infer,"
                        "reference_compute_log_prob]", f"{KEY}.profile_ranks=all",
                  f"{KEY}.profile_step_end=4", f"{KEY}.profile_save_path=")
    assert profiled_phases(config) == {"resharding_to_infer": "resharding_to_infer",
                                       "rollout": "actor_generate",
                                       "reference_model": "reference_compute_log_prob"}
    assert config.profiler_config.integrated.profile_save_path is None
    line = make_plan(config, 8).profiler
    assert "iterations 1-3 of this launch, all ranks" in line
    assert line.endswith("logs/grpo_qwen25_7b/profiler_data")
    # whole iterations; the PPO family's critic stages
    assert profiled_phases(load(path, f"{KEY}.stage=all")) is None
    ppo = load(written(tmp_path, {"profile": True, "stage": ["critic_compute_values",
                                                             "critic_update"]}, PPO),
               algorithm="ppo")
    assert profiled_phases(ppo) == {"values": "critic_compute_values",
                                    "critic_update": "critic_update"}
    # off by default: no notices, no plan line, and the section round-trips
    plain = load(CONFIG)
    assert not plain.profiler_config.integrated.profile and not make_plan(plain, 8).profiler
    assert plain.to_dict()["profiler_config"]["integrated"]["stage"] == "all"


@pytest.mark.parametrize("override, message", [
    ("stage=actor_generat", "stage='actor_generat': is neither a MindSpeed-RL stage nor a "
                            "phase of this job; use all, one of actor_generate,"),
    ("stage=[actor_generate,critic_update]", "stage='critic_update': this job runs no such "
                                             "work (its phases: resharding_to_infer -> rollout"),
    ("profile_step_end=1", "profile_step_end=1: the profiled iterations are "
                           "[profile_step_start, profile_step_end), counted from 1: [1, 1) is "
                           "empty"),
    ("profile_ranks=first", "profile_ranks='first': expected all or a list of ranks"),
    ("profile_ranks=[]", "profile_ranks=[]: needs at least one rank"),
    ("profile_ranks=[9]", "profile_ranks=[9]: rank 9 is outside the 8 ranks of this run; "
                          "use ranks 0..7"),
    ("profile_level=level3", "profile_level='level3' (command-line override): not an "
                             "accepted value; use one of: level_none, level0, level1, level2"),
])
def test_a_bad_profiler_setting_names_the_key(tmp_path, override, message):
    path = written(tmp_path, {"profile": True})
    with pytest.raises(ConfigError) as error:
        make_plan(load(path, f"{KEY}.{override}"), 8)
    assert f"{KEY}.{message}" in str(error.value)


class Settings:
    """A ``ProfilerSettings`` as the loader makes it (only what the recorder reads)."""

    def __init__(self, **kw):
        self.mstx = False
        self.profile_step_start, self.profile_step_end = 1, 2
        self.profile_with_cpu, self.profile_with_npu = True, True
        self.profile_record_shapes = self.profile_with_memory = False
        self.profile_with_module = self.profile_analysis = False
        self.__dict__.update(kw)


def iterations(n: int, *, fail_update_of: int | None = None) -> None:
    """``n`` trainer-like iterations through real phase timers, real operators inside; the
    update of iteration ``fail_update_of`` raises through its iteration (the next one runs)."""
    timers = Timers()
    a = torch.randn(64, 64)
    for it in range(1, n + 1):
        try:
            with timers.phase("all"):
                with timers.phase("rollout"):
                    torch.tanh(a)
                with timers.phase("update"):
                    a @ a
                    if it == fail_update_of:
                        raise RuntimeError("stopped")
        except RuntimeError:
            continue


def recorded(profiler, run):
    add_phase_observer(profiler.observe)
    try:
        run()
    finally:
        remove_phase_observer(profiler.observe)
        profiler.close()
    return profiler.written


def events(path) -> set[str]:
    return {e.get("name") for e in json.loads(open(path).read())["traceEvents"]}


def test_the_recorder_writes_one_trace_per_profiled_phase_and_iteration(tmp_path):
    profiler = PhaseProfiler(Settings(profile_step_start=2, profile_step_end=4,
                                      profile_analysis=True),
                             targets={"update": "actor_update"}, rank=3, folder=str(tmp_path))
    files = recorded(profiler, lambda: iterations(4))
    assert files == [str(tmp_path / "actor_update" / f"rank3_iter{k}.pt.trace.json")
                     for k in (2, 3)]
    names = events(files[0])
    assert {"aten::mm", "phase/update"} <= names and "aten::tanh" not in names  # update only
    summary = (tmp_path / "actor_update" / "rank3_iter2.txt").read_text()
    assert "aten::mm" in summary and "Self CPU" in summary
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(  # no temporary left
        ["actor_update", "rank3_iter2.pt.trace.json", "rank3_iter2.txt",
         "rank3_iter3.pt.trace.json", "rank3_iter3.txt"])


def test_whole_iterations_are_one_trace_with_every_phase_labelled(tmp_path):
    profiler = PhaseProfiler(Settings(profile_step_start=2, profile_step_end=4), targets=None,
                             rank=0, folder=str(tmp_path))
    (path,) = recorded(profiler, lambda: iterations(5))
    assert path == str(tmp_path / "integrated" / "rank0_iter2-3.pt.trace.json")
    trace = json.loads(open(path).read())["traceEvents"]
    labels = [e["name"] for e in trace if e.get("name", "").startswith(("phase/", "iter"))]
    assert sorted(labels) == ["iteration/2", "iteration/3", "phase/rollout", "phase/rollout",
                              "phase/update", "phase/update"]
    assert {"aten::mm", "aten::tanh"} <= {e.get("name") for e in trace}


def test_a_run_that_stops_inside_the_range_still_writes_its_trace(tmp_path):
    # an iteration fails in its update: its trace is written then, not after the next one
    for targets, stage in (({"update": "actor_update"}, "actor_update"), (None, "integrated")):
        profiler = PhaseProfiler(Settings(profile_step_end=3), targets=targets, rank=0,
                                 folder=str(tmp_path))
        first, *_ = recorded(profiler, lambda: iterations(3, fail_update_of=1))
        assert first == str(tmp_path / stage / "rank0_iter1.pt.trace.json")
        assert "aten::mm" in events(first) and "iteration/2" not in events(first)
    # the run ends (train_iters) before profile_step_end: close() writes what was recorded
    profiler = PhaseProfiler(Settings(profile_step_end=10), targets=None, rank=0,
                             folder=str(tmp_path / "short"))
    (path,) = recorded(profiler, lambda: iterations(2))
    assert path.endswith("integrated/rank0_iter1-2.pt.trace.json")


def test_trace_phases_splits_each_phase_into_where_its_time_went(tmp_path, capsys):
    """tools/trace_phases.py on a recorded trace: each phase's wall time is the operators'
    self times by kind plus the time between operators, nothing counted twice."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from trace_phases import main, split

    def run():
        timers, a = Timers(), torch.randn(256, 256)
        with timers.phase("all"):
            with timers.phase("rollout"):
                torch.tanh(a).sum()
            with timers.phase("update"):
                torch.nn.functional.linear(a, a).to(torch.float64)
                sum(range(200_000))  # Python between operators
    profiler = PhaseProfiler(Settings(), targets=None, rank=0, folder=str(tmp_path))
    (path,) = recorded(profiler, run)
    result = split(json.loads(open(path).read()))
    assert set(result) == {"rollout", "update"}
    update, rollout = result["update"]["ms"], result["rollout"]["ms"]
    assert update["matmul"] > 0 and update["copy/cast"] > 0 and rollout["matmul"] == 0
    assert rollout["other operators"] > 0 and update["between operators"] > update["matmul"]
    for phase in result.values():
        assert sum(phase["ms"].values()) == pytest.approx(phase["wall_ms"], rel=1e-6)
    assert main([path]) == 0
    assert "update:" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "trace_phases: error:" in capsys.readouterr().err
