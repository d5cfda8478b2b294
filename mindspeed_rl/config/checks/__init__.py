"""The checks of a loaded job that do not depend on the world size, one module per concern.

Each module's ``check_<concern>(config)`` raises `ConfigError` naming the key(s) at fault, the
value and a fix; `check_job` runs them in a fixed order (the first error wins). The checks
that read the disk are `job_files.check_data_files`'s; those that depend on the world size
(layouts, batch splits over data-parallel ranks) are the plan's (`config/plan_layout.py`).
"""

from mindspeed_rl.config.checks import (algorithm_roles, dapo_clip, generation_features,
                                        length_budgets, model_ranges, partial_rollout_split,
                                        reward_scoring, rollout_staleness, routing_replay,
                                        tool_turns, training_features)
from mindspeed_rl.config.preference import check_not_pairwise, check_preference_job
from mindspeed_rl.config.profiling import check_profiler
from mindspeed_rl.config.teacher import check_teacher


def check_job(config) -> None:
    """Raise `ConfigError` for the first inconsistency found (model, ranges, cross-key)."""
    model_ranges.check_model_ranges(config)
    check_profiler(config)
    if config.features.pairs:  # DPO: no rollout, no reward (config/preference.py)
        training_features.check_training_features(config)
        check_preference_job(config)
        return
    check_not_pairwise(config)
    dapo_clip.check_dapo(config)  # before the group-size check: its message names the DAPO key
    rollout_staleness.check_rollout_correction(config)
    routing_replay.check_router_replay(config)
    algorithm_roles.check_algorithm_roles(config)
    length_budgets.check_lengths(config)
    training_features.check_training_features(config)  # recompute, stages, CP, LoRA
    generation_features.check_generation_features(config)
    partial_rollout_split.check_partial_rollout(config)
    tool_turns.check_multi_turn(config)
    reward_scoring.check_reward_scoring(config)
    check_teacher(config)  # on-policy distillation (config/teacher.py)
