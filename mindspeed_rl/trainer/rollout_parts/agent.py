"""The agent of tool turns (``rl_config.multi_turn_enable``, docs/multi_turn.md): the tool
pool as each vLLM instance sees it, the chat template of tool turns, the call parser and
the loop's limits; built once per run, at its first use (``Roles.agent``)."""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.agent_tools.parser import tool_parser
from mindspeed_rl.rollout.agent_loop import AgentLimits, ToolTurnTemplate


@dataclass
class Agent:
    """What the agent loop needs beyond the engine."""

    pool: "InstancePool"
    template: ToolTurnTemplate
    parse: object
    limits: AgentLimits

    def close(self) -> None:
        self.pool.close()


def agent_of(roles, config, tokenizer, world: int) -> Agent:
    """The run's agent, built at its first use (every rank at once: the groups of the tool
    pool's instances are created collectively)."""
    if roles.agent is None:
        roles.agent = _build_agent(config, tokenizer, world)
    return roles.agent


def _build_agent(config, tokenizer, world: int) -> Agent:
    from mindspeed_rl.agent_tools.config import load_tool_config
    from mindspeed_rl.agent_tools.tool_pool import ToolPool

    rl = config.rl_config
    pool = InstancePool(ToolPool(load_tool_config(rl.tool_config_path)),
                        config.generate_config.infer_tensor_parallel_size, world)
    return Agent(pool, ToolTurnTemplate(tokenizer), tool_parser(rl.tool_parser_format),
                 AgentLimits.from_config(rl, config.sampling_config.max_tokens))


class InstancePool:
    """The tool pool as one vLLM instance sees it: its first rank runs the calls and the
    other ranks of the instance receive the results (a gloo group per instance), so every
    rank appends the same tokens (the engine's collective generate needs every rank's
    prompts equal); with infer_tensor_parallel_size 1 every rank is its own instance and
    runs its calls itself."""

    def __init__(self, pool, tp_g: int, world: int) -> None:
        import torch.distributed as dist

        self.pool, self.group = pool, None
        if tp_g > 1:  # every rank creates every instance's group (a collective call)
            rank = dist.get_rank()
            for start in range(0, world, tp_g):
                group = dist.new_group(list(range(start, start + tp_g)), backend="gloo")
                if start <= rank < start + tp_g:
                    self.group, self.src = group, start

    def run(self, calls):
        if self.group is None:
            return self.pool.run(calls)
        import torch.distributed as dist

        results = [self.pool.run(calls) if dist.get_rank() == self.src else None]
        dist.broadcast_object_list(results, src=self.src, group=self.group)
        return results[0]

    def submit(self, call):
        """One call, run in the background (the step-wise loop; vLLM TP 1 only)."""
        return self.pool.submit(call)

    def close(self) -> None:
        self.pool.close()
