"""Job configuration: YAML + dotted overrides -> validated dataclasses, and the dry-run plan.

    config = load_config("configs/grpo_qwen25_7b.yaml", ["rl_config.n_samples_per_prompt=8"])
    plan = make_plan(config, world_size=16)      # raises ConfigError before any process group
    print(plan.format())

Pure Python: importing this package imports neither torch nor megatron.
"""

from mindspeed_rl.config.cli import LauncherArgs, main, parse_launcher_args
from mindspeed_rl.config.config_error import ConfigError
from mindspeed_rl.config.loader import apply_overrides, load_config, parse_override
from mindspeed_rl.config.model_spec import ModelSpec
from mindspeed_rl.config.plan import Plan, make_plan
from mindspeed_rl.config.plan_layout import accepted_world_sizes
from mindspeed_rl.config.rank_parameters import params_per_rank
from mindspeed_rl.config.schema import (SECTIONS, ActorConfig, GenerateConfig,
                                        MegatronTrainingConfig, RLConfig, RLJobConfig,
                                        SamplingConfig)

__all__ = [
    "SECTIONS", "ActorConfig", "ConfigError", "GenerateConfig", "LauncherArgs",
    "MegatronTrainingConfig", "ModelSpec", "Plan", "RLConfig", "RLJobConfig", "SamplingConfig",
    "accepted_world_sizes", "apply_overrides", "load_config", "main", "make_plan",
    "params_per_rank", "parse_launcher_args", "parse_override",
]
