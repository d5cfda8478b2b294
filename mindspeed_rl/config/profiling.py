"""``profiler_config.integrated``: MindSpeed-RL's profiler stages in this job's phases, the
checks of the section, and the dry run's line.

MindSpeed-RL names the profiled part of an iteration by the worker call that runs it; here an
iteration is a list of phases (``mindspeed_rl/algorithms/phase_names.py``), so each of its
stages is the phase that does that work. The profiler itself is
``mindspeed_rl/metrics/profiler.py``.
"""

from __future__ import annotations

import os

from mindspeed_rl.algorithms import phase_names as names
from mindspeed_rl.config.config_error import ConfigError

WHOLE_ITERATION = "all"
# MindSpeed-RL's stage -> the phases that do its work here (DPO's update is its own phase).
STAGES = {
    "actor_generate": (names.ROLLOUT,),
    "actor_compute_log_prob": (names.OLD_LOG_P,),
    "reference_compute_log_prob": (names.REFERENCE_MODEL,),
    "critic_compute_values": (names.VALUES,),
    "actor_update": (names.UPDATE, names.PREFERENCE_UPDATE),
    "critic_update": (names.CRITIC_UPDATE,),
}
_KEY = "profiler_config.integrated"


def stages(settings) -> tuple[str, ...]:
    """``stage`` as a tuple (MindSpeed-RL takes one name or a list)."""
    return (settings.stage,) if isinstance(settings.stage, str) else tuple(settings.stage)


def profiled_phases(config) -> dict[str, str] | None:
    """The phases to profile, in the job's order, each with the stage it was asked by (its
    traces' folder); None: whole iterations (``stage: all``)."""
    wanted = stages(config.profiler_config.integrated)
    if WHOLE_ITERATION in wanted:
        return None
    asked = {phase: stage for stage in wanted for phase in STAGES.get(stage, (stage,))}
    return {p: asked[p] for p in config.features.phases if p in asked}


def check_profiler(config) -> None:
    """Stage names this job runs, a non-empty step range, ranks as MindSpeed-RL writes them."""
    s = config.profiler_config.integrated
    if not s.profile:
        return
    runs = config.features.phases
    for stage in stages(s):
        if stage == WHOLE_ITERATION:
            continue
        if stage not in STAGES and stage not in runs:
            raise ConfigError(f"{_KEY}.stage", "is neither a MindSpeed-RL stage nor a phase "
                              "of this job", f"use all, one of {', '.join(STAGES)}, or a "
                              f"phase of: {', '.join(runs)}", value=stage)
        if not set(STAGES.get(stage, (stage,))) & set(runs):
            raise ConfigError(f"{_KEY}.stage", f"this job runs no such work (its phases: "
                              f"{' -> '.join(runs)})", "profile a stage the job runs, or all",
                              value=stage)
    if s.profile_step_start < 1 or s.profile_step_end <= s.profile_step_start:
        raise ConfigError(f"{_KEY}.profile_step_end", "the profiled iterations are [profile_"
                          f"step_start, profile_step_end), counted from 1: "
                          f"[{s.profile_step_start}, {s.profile_step_end}) is empty",
                          "e.g. profile_step_start: 1, profile_step_end: 2 (the first "
                          "iteration)", value=s.profile_step_end)
    if isinstance(s.profile_ranks, str) and s.profile_ranks != "all":
        raise ConfigError(f"{_KEY}.profile_ranks", "expected all or a list of ranks",
                          "e.g. profile_ranks: [0]", value=s.profile_ranks)
    if not isinstance(s.profile_ranks, str) and (
            not s.profile_ranks or min(s.profile_ranks) < 0):
        raise ConfigError(f"{_KEY}.profile_ranks", "needs at least one rank, none negative",
                          "e.g. profile_ranks: [0], or all", value=list(s.profile_ranks))


def recording_ranks(settings, world_size: int) -> tuple[int, ...]:
    """The ranks that record; a rank outside the world is an error naming the key."""
    if isinstance(settings.profile_ranks, str):
        return tuple(range(world_size))
    outside = [r for r in settings.profile_ranks if r >= world_size]
    if outside:
        raise ConfigError(f"{_KEY}.profile_ranks", f"rank {outside[0]} is outside the "
                          f"{world_size} ranks of this run", f"use ranks 0..{world_size - 1}",
                          value=list(settings.profile_ranks))
    return tuple(sorted(set(settings.profile_ranks)))


def profiler_line(config, world_size: int) -> str:
    """What the dry run prints: which phases of which iterations on which ranks ("" when off)."""
    s = config.profiler_config.integrated
    if not s.profile:
        return ""
    ranks = recording_ranks(s, world_size)
    phases = profiled_phases(config)
    what = "whole iterations" if phases is None else "phases " + ", ".join(phases)
    last = s.profile_step_end - 1
    when = (f"iteration {s.profile_step_start}" if last == s.profile_step_start
            else f"iterations {s.profile_step_start}-{last}")
    shown = "all ranks" if len(ranks) == world_size else "ranks " + ", ".join(map(str, ranks))
    return (f"profiler: torch.profiler, {what}, {when} of this launch, {shown} -> "
            f"{trace_folder(config)}")


def trace_folder(config) -> str:
    """Where the traces go: ``profile_save_path``, else the log folder's ``profiler_data``."""
    s = config.profiler_config.integrated
    return s.profile_save_path or os.path.join(config.megatron_training.log_dir, "profiler_data")


def profiler_notices(settings) -> list[str]:
    """The torch_npu-only values of a profiling config, said once with the plan."""
    if not settings.profile:
        return []
    out = []
    if settings.profile_export_type == "db":
        out.append(f"{_KEY}.profile_export_type=db: torch_npu's database export; torch's "
                   "profiler writes the text export (Chrome trace JSON) here")
    if settings.profile_level != "level0":
        out.append(f"{_KEY}.profile_level={settings.profile_level}: torch_npu's collection "
                   "level; torch's profiler has none and records every operator")
    return out
