"""The layouts of a job on a world size, checked before any process group exists.

`checked_layout` builds the training and generation layouts (`ParallelLayout`) and checks
the model's divisibility by TP / PP / EP / TP_g and the batch splits over data-parallel
ranks; `reference_layout_lines` checks the reference's own layout (``ref_config``'s TP x PP);
`accepted_world_sizes` finds the world sizes a config accepts.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mindspeed_rl.config.deepseek_checks import mla_tensor_parallel_problem
from mindspeed_rl.config.config_error import ConfigError
from mindspeed_rl.config.schema import RLJobConfig
from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout

# ParallelLayout names its keys without section; the user wrote them in these sections.
_LAYOUT_KEYS = {
    "world_size": "world_size",
    "tensor_model_parallel_size": "actor_config.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "actor_config.pipeline_model_parallel_size",
    "context_parallel_size": "actor_config.context_parallel_size",
    "context_parallel_algo": "actor_config.context_parallel_algo",
    "expert_model_parallel_size": "actor_config.expert_model_parallel_size",
    "expert_tensor_parallel_size": "actor_config.expert_tensor_parallel_size",
    "sequence_parallel": "megatron_training.sequence_parallel",
    "infer_tensor_parallel_size": "generate_config.infer_tensor_parallel_size",
    "num_layers": "num_hidden_layers",    # megatron's name; the model files use HF names
    "num_layer_list": "actor_config.num_layer_list",
}


def accepted_world_sizes(config: RLJobConfig, count: int = 4, limit: int = 8192) -> list[int]:
    """The first ``count`` world sizes (up to ``limit``) for which ``config`` is valid."""
    step = _world_size_step(config)
    found = []
    for world_size in range(step, limit + 1, step):
        try:
            checked_layout(config, world_size)
        except ConfigError:
            continue
        found.append(world_size)
        if len(found) == count:
            break
    return found


def _world_size_step(config: RLJobConfig) -> int:
    """Every valid world size is a multiple of this (TP x PP, EP x TP x PP and TP_g tile it)."""
    a, g = config.actor_config, config.generate_config
    tp_pp = (a.tensor_model_parallel_size * a.context_parallel_size
             * a.pipeline_model_parallel_size)
    etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size
    return math.lcm(tp_pp, a.expert_model_parallel_size * etp * a.pipeline_model_parallel_size,
                    g.infer_tensor_parallel_size * g.infer_expert_parallel_size)


def _layout_sizes(config: RLJobConfig, world_size: int) -> dict[str, Any]:
    a = config.actor_config
    return dict(world_size=world_size,
                tensor_model_parallel_size=a.tensor_model_parallel_size,
                pipeline_model_parallel_size=a.pipeline_model_parallel_size,
                expert_model_parallel_size=a.expert_model_parallel_size,
                expert_tensor_parallel_size=a.expert_tensor_parallel_size,
                sequence_parallel=config.megatron_training.sequence_parallel,
                infer_tensor_parallel_size=config.generate_config.infer_tensor_parallel_size,
                context_parallel_size=a.context_parallel_size)


def checked_layout(config: RLJobConfig, world_size: int) -> ParallelLayout:
    """The training and generation layouts of ``config`` on ``world_size`` ranks, checked:
    the model's divisibility by the parallel sizes, then the batch splits over the
    generation and training data-parallel ranks."""
    a, g, m = config.actor_config, config.generate_config, config.model
    try:
        # Model divisibility does not depend on the world size: check it first, on the
        # smallest world the parallel sizes tile, so the error points at the real culprit.
        smallest = ParallelLayout(**_layout_sizes(config, _world_size_step(config)))
        smallest.check_model(num_attention_heads=m.num_attention_heads,
                             num_query_groups=m.num_kv_heads, num_layers=m.num_hidden_layers,
                             num_experts=m.num_experts if m.is_moe else None,
                             num_layer_list=a.num_layer_list,
                             context_parallel_algo=a.context_parallel_algo)
        layout = ParallelLayout(**_layout_sizes(config, world_size))
    except LayoutError as e:
        raise ConfigError(None, _with_sections(str(e))) from None
    if m.is_mla:
        problem = mla_tensor_parallel_problem(m, a.tensor_model_parallel_size,
                                              "actor_config.tensor_model_parallel_size")
        if problem is not None:
            raise problem

    gbs, n = config.megatron_training.global_batch_size, config.rl_config.n_samples_per_prompt
    mini = config.rl_config.mini_batch_size
    dp_g, tpg = layout.infer_data_parallel_size, g.infer_tensor_parallel_size
    gen = config.rl_config.gen_batch_size
    if gen is not None and gen % dp_g:
        raise ConfigError(
            "rl_config.gen_batch_size", f"not divisible by the generation data-parallel size "
            f"{dp_g}: every vLLM instance must get the same number of prompts",
            f"use a multiple of {dp_g}, e.g. {_round_up(gen, dp_g)}", value=gen)
    if gbs % dp_g:
        raise ConfigError(
            "megatron_training.global_batch_size",
            f"not divisible by the generation data-parallel size {dp_g} (world size "
            f"{world_size} / generate_config.infer_tensor_parallel_size={tpg}): every vLLM "
            "instance must get the same number of prompts",
            f"use a multiple of {dp_g} that rl_config.mini_batch_size={mini} divides, e.g. "
            f"{_round_up(gbs, math.lcm(dp_g, mini))}", value=gbs)
    epg = g.infer_expert_parallel_size
    if dp_g % epg:
        raise ConfigError(
            "generate_config.infer_expert_parallel_size",
            f"does not divide the generation data-parallel size {dp_g} (world size {world_size} "
            f"/ generate_config.infer_tensor_parallel_size={tpg}): each expert-parallel group "
            "spans that many vLLM replicas", f"use a divisor of {dp_g}", value=epg)
    if g.enable_expert_parallel and m.is_moe and m.num_experts % (tpg * epg):
        raise ConfigError(
            "generate_config.infer_expert_parallel_size",
            f"vLLM's expert-parallel size infer_tensor_parallel_size={tpg} x {epg} = {tpg * epg} "
            f"does not divide the model's num_experts={m.num_experts}",
            "choose sizes whose product divides the experts", value=epg)
    dp, mbs = layout.data_parallel_size, a.micro_batch_size
    if (mini * n) % (dp * mbs):
        raise ConfigError(
            "rl_config.mini_batch_size",
            f"{mini} prompts x rl_config.n_samples_per_prompt={n} = {mini * n} responses per "
            f"optimizer step do not split into training data-parallel size {dp} x "
            f"actor_config.micro_batch_size={mbs} = {dp * mbs} per micro-batch round",
            f"make mini_batch_size x n_samples_per_prompt a multiple of {dp * mbs}", value=mini)
    critic = config.critic_config
    if critic is not None and (mini * n) % (dp * critic.micro_batch_size):
        cmbs = critic.micro_batch_size
        raise ConfigError(
            "critic_config.micro_batch_size",
            f"rl_config.mini_batch_size={mini} x n_samples_per_prompt={n} = {mini * n} responses "
            f"per critic step do not split into training data-parallel size {dp} x "
            f"critic_config.micro_batch_size={cmbs} = {dp * cmbs} per micro-batch round",
            f"use a micro_batch_size that divides {mini * n // dp}", value=cmbs)
    return layout


def reference_own_layout(config: RLJobConfig) -> tuple[int, int] | None:
    """ref_config's own (TP, PP) when it differs from the actor's, else None."""
    r, a = config.ref_config, config.actor_config
    tp = r.tensor_model_parallel_size or a.tensor_model_parallel_size
    pp = r.pipeline_model_parallel_size or a.pipeline_model_parallel_size
    same = (tp, pp) == (a.tensor_model_parallel_size, a.pipeline_model_parallel_size)
    return None if same or config.rl_config.init_kl_coef <= 0 else (tp, pp)


def reference_layout_lines(config: RLJobConfig, world_size: int) -> list[str]:
    """The reference's own layout (ref_config's TP x PP): it must tile the world and split
    the model as the actor's does."""
    own = reference_own_layout(config)
    if own is None:
        return []
    tp, pp = own
    m = config.model
    for bad, key, why in (
            (world_size % (tp * pp), "tensor_model_parallel_size",
             f"TP={tp} x PP={pp} does not divide the world of {world_size} ranks"),
            (m.num_attention_heads % tp or m.num_kv_heads % tp and tp % m.num_kv_heads,
             "tensor_model_parallel_size", f"TP={tp} does not split the model's "
             f"{m.num_attention_heads} query / {m.num_kv_heads} KV heads"),
            (m.is_mla and mla_tensor_parallel_problem(m, tp, "") is not None,
             "tensor_model_parallel_size", f"TP={tp} does not split the model's multi-latent "
             f"attention down projections (q_lora_rank={m.q_lora_rank}, kv_lora_rank + "
             f"qk_rope_head_dim={m.kv_latent_dim})"),
            (pp > m.num_hidden_layers, "pipeline_model_parallel_size",
             f"PP={pp} exceeds the model's {m.num_hidden_layers} layers")):
        if bad:
            raise ConfigError(f"ref_config.{key}", why, "give the reference a TP x PP that "
                              "tiles the world and splits the model, or remove the key to run "
                              "it in the actor's layout", value=tp if "tensor" in key else pp)
    return [f"reference  runs in its own layout: TP {tp} x PP {pp} x DP {world_size // (tp * pp)} "
            "over the actor's ranks (ref_config, MindSpeed-RL's separate reference worker)"]


def _with_sections(message: str) -> str:
    """Rewrite ParallelLayout's bare key names into the dotted keys of the YAML."""
    return re.sub(r"\b(" + "|".join(_LAYOUT_KEYS) + r")\b",
                  lambda match: _LAYOUT_KEYS[match.group(1)], message)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
