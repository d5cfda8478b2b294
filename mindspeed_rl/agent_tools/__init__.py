"""Tools for multi-turn agentic rollouts (MindSpeed-RL's ReTool recipe), docs/tools.md.

- :mod:`~mindspeed_rl.agent_tools.config`: the tool YAML (MindSpeed-RL's format) and the
  hermes tools block of the system prompt;
- :mod:`~mindspeed_rl.agent_tools.parser`: ``<tool_call>`` blocks in the model's text, and
  tool responses cut to ``max_tool_response_length`` characters;
- :mod:`~mindspeed_rl.agent_tools.code_interpreter`: Python in a sandboxed, limited child process;
- :mod:`~mindspeed_rl.agent_tools.sandbox`: the bubblewrap + seccomp sandbox it runs in;
- :mod:`~mindspeed_rl.agent_tools.sandbox_fusion`: a client of a SandboxFusion service;
- :mod:`~mindspeed_rl.agent_tools.tool_pool`: a batch of calls run concurrently, each bounded
  in time.

Nothing here imports torch or vLLM.
"""

from mindspeed_rl.agent_tools.code_interpreter import CodeInterpreter
from mindspeed_rl.agent_tools.config import (ToolConfigError, ToolSpec, load_tool_config,
                                       tool_system_prompt)
from mindspeed_rl.agent_tools.parser import ParseResult, ToolCall, parse_hermes, truncate
from mindspeed_rl.agent_tools.tool_pool import ToolPool
from mindspeed_rl.agent_tools.result import ToolResult
from mindspeed_rl.agent_tools.sandbox_fusion import SandboxFusionClient

__all__ = [
    "CodeInterpreter", "ParseResult", "SandboxFusionClient", "ToolCall", "ToolConfigError",
    "ToolPool", "ToolResult", "ToolSpec", "load_tool_config", "parse_hermes", "tool_system_prompt",
    "truncate",
]
