"""Checks of multi-turn rollouts with tools (``rl_config.multi_turn_enable``).

`check_multi_turn` runs in the dry run (the tool YAML is read, no tool is called);
`check_tool_sandbox` runs one call in the local code interpreter's sandbox, with the data
checks (`config/checks/job_files.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.algorithms import registry
from mindspeed_rl.config.config_error import ConfigError, require
from mindspeed_rl.config.features import family_supports

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig

TOOL_PROMPT_TYPES = ("qwen_retool",)  # prompt types whose template describes the tools


def check_multi_turn(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first multi-turn key set up wrong: the family and the
    estimator, the tool YAML, the prompt template, the tool-call limits, the parser."""
    rl, key = config.rl_config, "rl_config.multi_turn_enable"
    require(rl.max_tool_response_length > 0, "rl_config.max_tool_response_length",
            rl.max_tool_response_length, "must be positive (characters of a tool response "
            "kept)", "use e.g. 256")
    if not config.features.multi_turn:
        return
    require(family_supports(config, "multi_turn"), key, True, "multi-turn rollouts run with "
            "GRPO and DAPO (pretrain_grpo.py), as in MindSpeed-RL; PPO's critic and GAE are not "
            "built for responses with tool tokens", "set multi_turn_enable: false for PPO")
    estimator = registry.estimator(rl.adv_estimator)
    sequence_level = [e.name for e in registry.estimators(config.algorithm) if e.whole_groups]
    require(estimator.whole_groups, "rl_config.adv_estimator", rl.adv_estimator,
            "its per-token returns are not built for responses with tool tokens inside "
            "(multi_turn_enable)", f"use one of {sequence_level} with multi_turn_enable")
    require(rl.tool_config_path is not None, "rl_config.tool_config_path", None,
            "multi_turn_enable needs the tool YAML", "e.g. configs/tools/code_interpreter.yaml")
    # null: MindSpeed-RL's configs leave it to their preprocessed (indexed) data, whose
    # prompts were rendered with qwen_retool; check_data_files refuses null on raw prompts.
    require(config.megatron_training.prompt_type in TOOL_PROMPT_TYPES + (None,),
            "megatron_training.prompt_type", config.megatron_training.prompt_type,
            "has no tool template: the model would not be told which tools it can call or "
            "how", f"use one of {list(TOOL_PROMPT_TYPES)} with multi_turn_enable")
    require(rl.max_tool_calls >= 0, "rl_config.max_tool_calls", rl.max_tool_calls,
            "must be at least 0", "use e.g. 1")
    require(rl.max_parallel_calls >= 1, "rl_config.max_parallel_calls", rl.max_parallel_calls,
            "must be at least 1", "use e.g. 1")
    max_tokens = config.sampling_config.max_tokens
    require(config.features.response_limit >= max_tokens, "rl_config.max_total_response_length",
            rl.max_total_response_length, f"is smaller than generate_config.sampling_config."
            f"max_tokens={max_tokens} (MindSpeed-RL refuses the same)",
            f"use at least {max_tokens}")
    from mindspeed_rl.agent_tools.config import ToolConfigError, load_tool_config
    from mindspeed_rl.agent_tools.parser import tool_parser

    try:
        tool_parser(rl.tool_parser_format)
    except ValueError as e:
        raise ConfigError("rl_config.tool_parser_format", str(e),
                          value=rl.tool_parser_format) from None

    try:
        load_tool_config(rl.tool_config_path)
    except ToolConfigError as e:
        raise ConfigError("rl_config.tool_config_path", str(e), "fix the tool YAML "
                          "(docs/tools.md)", value=rl.tool_config_path) from None


def check_tool_sandbox(config: RLJobConfig) -> None:
    """The local code interpreter's sandbox runs on this machine (one call is run in it), or
    its tool opted out explicitly (a warning, once per run): never a silent downgrade."""
    rl = config.rl_config
    if not config.features.multi_turn or rl.tool_config_path is None:
        return
    from mindspeed_rl.agent_tools.config import load_tool_config
    from mindspeed_rl.agent_tools.preflight import local_interpreter_problem

    for spec in load_tool_config(rl.tool_config_path):
        if spec.kind != "code_interpreter":
            continue
        problem = local_interpreter_problem(spec, rl.tool_config_path)
        if problem is not None:
            raise ConfigError("rl_config.tool_config_path", problem, value=rl.tool_config_path)
