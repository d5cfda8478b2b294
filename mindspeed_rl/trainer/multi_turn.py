"""The rollout phase with tools (``rl_config.multi_turn_enable``, docs/multi_turn.md).

Each generation-DP rank runs the agent loop (``mindspeed_rl.rollout.agent_loop``) over
the n trajectories of each of its prompts; the first rank of each vLLM instance puts the
rows, with ``response_mask`` (1 on the model's tokens) and ``tool_calls``. Tool calls
run on every rank of an instance alike would run them twice, so with
``infer_tensor_parallel_size`` > 1 the instance's first rank runs them and broadcasts
the results (the engine's collective generate needs every rank's prompts equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_rl.rollout.agent_loop import (AgentLimits, ToolTurnTemplate, run_agent_loop,
                                             run_agent_loop_stepwise, trajectories_for)
from mindspeed_rl.agent_tools.parser import tool_parser
from mindspeed_rl.trainer.columns import FINISH_REASONS
from mindspeed_rl.trainer.context import PhaseContext
from mindspeed_rl.trainer.reductions import global_stats, global_sums
from mindspeed_rl.trainer.rollout_rows import columns_of, fresh_rows, row_columns


@dataclass
class Agent:
    """What the loop needs beyond the engine, built once per run (``Roles.agent``)."""

    pool: "_InstancePool"
    template: ToolTurnTemplate
    parse: object
    limits: AgentLimits

    def close(self) -> None:
        self.pool.close()


def stepwise_turns(config) -> bool:
    """Whether multi-turn rollouts run the step-wise loop: rl_config.async_engine, with vLLM
    TP 1 (with TP > 1 the ranks of an instance must add the same requests at the same
    steps, so there the turns stay batch-wide)."""
    return config.rl_config.async_engine and config.generate_config.infer_tensor_parallel_size == 1


def loop_line(config) -> str | None:
    """The plan's line on how multi-turn rollouts advance (None without multi-turn)."""
    rl = config.rl_config
    if not rl.multi_turn_enable:
        return None
    if stepwise_turns(config):
        return ("multi-turn: step-wise (rl_config.async_engine): each trajectory continues as "
                "soon as its own tool calls are back")
    why = ("rl_config.async_engine is off" if not rl.async_engine else
           "with infer_tensor_parallel_size > 1 an instance's ranks add requests together")
    return f"multi-turn: batch-wide turns, each waits for its slowest tool call ({why})"


def build_agent(config, tokenizer, world: int) -> Agent:
    from mindspeed_rl.agent_tools.config import load_tool_config
    from mindspeed_rl.agent_tools.pool import ToolPool

    rl = config.rl_config
    pool = _InstancePool(ToolPool(load_tool_config(rl.tool_config_path)),
                         config.generate_config.infer_tensor_parallel_size, world)
    return Agent(pool, ToolTurnTemplate(tokenizer),
                 tool_parser(rl.tool_parser_format),
                 AgentLimits.from_config(rl, config.sampling_config.max_tokens))


def run_trajectories(agent: Agent, engine, tokenizer, prompts, n: int, sampling, seeds, *,
                     stepwise: bool = False):
    """(n trajectories per prompt, the loop's stats): the agent loop on ``engine``;
    ``stepwise`` (:func:`stepwise_turns`): each trajectory advances on its own
    (run_agent_loop_stepwise)."""
    trajectories = trajectories_for(prompts, n, seeds)
    return trajectories, advance(agent, engine, tokenizer, trajectories, sampling,
                                 stepwise=stepwise)


def advance(agent: Agent, engine, tokenizer, trajectories, sampling, *, stepwise: bool = False):
    """Run the agent loop on ``trajectories`` until each is done, or paused at its pass
    budget (``Trajectory.pass_left``, partial rollout); the loop's stats."""
    common = dict(template=agent.template, parse=agent.parse, limits=agent.limits,
                  decode=tokenizer.decode, eos_token_id=tokenizer.eos_token_id)
    if stepwise:
        return run_agent_loop_stepwise(engine, trajectories, sampling=sampling,
                                       pool=agent.pool.pool, **common)

    def generate(token_prompts, turn_seeds, budgets):
        result = engine.generate(token_prompts, 1, sampling, seeds=turn_seeds,
                                 max_tokens=budgets, use_tqdm=False)
        return [group[0] for group in result.completions]

    return run_agent_loop(generate, trajectories, pool=agent.pool,
                          max_tokens=sampling.max_tokens, **common)


def agent_of(roles, config, tokenizer, world: int) -> Agent:
    """The run's agent, built at its first use (every rank at once: the groups of the tool
    pool's instances are created collectively)."""
    if roles.agent is None:
        roles.agent = build_agent(config, tokenizer, world)
    return roles.agent


def multi_turn_rollout(ctx: PhaseContext) -> dict[str, float]:
    """n trajectories per prompt of this generation-DP rank's share, turn by turn."""
    n, me = ctx.rl.n_samples_per_prompt, ctx.ranks
    agent = agent_of(ctx.roles, ctx.config, ctx.tokenizer, me.world)
    mine, first_group, seeds = ctx.take_round_prompts()
    prompts = [ctx.train_data[i].prompt_ids for i in mine]
    rows = fresh_rows(prompts, mine, first_group, n, ctx.roles.actor.weight_version, seeds)
    trajectories = [r.t for r in rows]
    stats = advance(agent, ctx.roles.rollout, ctx.tokenizer, trajectories,
                    ctx.config.sampling_config, stepwise=stepwise_turns(ctx.config))
    for r in rows:
        r.finish = FINISH_REASONS.index(r.t.finish_reason)
    names = row_columns(partial=False, multi_turn=True, routing=ctx.rl.router_replay == "R3")
    ctx.flow.put_rows(columns_of(rows, names) if me.is_gen_writer else {}, group_size=n)
    return _metrics(ctx, trajectories, prompts, stats.tool_seconds)


def _metrics(ctx, trajectories, prompts, tool_seconds) -> dict[str, float]:
    """Turns and tool calls per trajectory, tool error / timeout rates, tool seconds and
    the response tokens split into the model's and the rest (tools, template glue)."""
    writer, n = ctx.ranks.is_gen_writer, ctx.rl.n_samples_per_prompt
    own = trajectories if writer else []
    stats = global_stats("response_length", [float(len(t.tokens)) for t in trajectories],
                         writer)
    for name, values in (("turns", [float(t.turns) for t in trajectories]),
                         ("tool_calls", [float(t.tool_calls) for t in trajectories]),
                         ("tool_call_rate", [float(t.tool_calls > 0) for t in trajectories])):
        s = global_stats(name, values, writer)
        stats[f"multi_turn/{name}"] = s[f"{name}/mean"]
        if name != "tool_call_rate":
            stats[f"multi_turn/{name}_max"] = s[f"{name}/max"]
    model, total, calls, errors, timeouts, prompt_tokens, seconds = global_sums([
        float(sum(t.model_tokens for t in own)), float(sum(len(t.tokens) for t in own)),
        float(sum(t.tool_calls for t in own)), float(sum(t.tool_errors for t in own)),
        float(sum(t.tool_timeouts for t in own)),
        float(sum(len(p) for p in prompts) * n) if writer else 0.0,
        tool_seconds if writer else 0.0])
    stats.update({
        "prompt_length/mean": prompt_tokens / ctx.batch.responses_per_iteration,
        "tokens/response": total, "tokens/prompt": prompt_tokens,
        "multi_turn/model_tokens": model, "multi_turn/tool_tokens": total - model,
        "multi_turn/tool_error_rate": errors / max(calls, 1.0),
        "multi_turn/tool_timeout_rate": timeouts / max(calls, 1.0),
        # seconds the rank waited for tools, averaged over the vLLM instances
        "timing/tools": seconds / ctx.plan.layout.infer_data_parallel_size,
    })
    return stats


class _InstancePool:
    """The tool pool as one vLLM instance sees it: its first rank runs the calls and the
    other ranks of the instance receive the results (a gloo group per instance), so every
    rank appends the same tokens; with infer_tensor_parallel_size 1 every rank is its own
    instance and runs its calls itself."""

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

    def close(self) -> None:
        self.pool.close()
