"""Checks of the sequence lengths and the token budgets.

A longest prompt leaves room for a response in vLLM's ``max_model_len``, which fits the
model's positions. A response that would run past ``max_model_len`` is stopped there by
vLLM (finish reason "length"), as MindSpeed-RL runs it: a warning (`response_cut_warning`)
says how many tokens a longest prompt's response loses; with tool turns or partial rollout,
which continue a row from its tokens so far, the whole row must fit. ``seq_length``,
``min_tokens`` and vLLM's batched tokens agree; with ``use_dynamic_bsz`` each micro-batch
phase's packing budget (`config/batch_plan.py`'s `packing_budgets`) holds the longest row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.batch_plan import longest_prompt, longest_row, packing_budgets
from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def _row(config: RLJobConfig) -> tuple[str, int, str, int]:
    """(the prompt's key, the longest prompt, the response limit's key, the limit)."""
    key, prompt = longest_prompt(config)
    what = ("rl_config.max_total_response_length" if config.features.multi_turn
            else "generate_config.sampling_config.max_tokens")
    return key, prompt, what, config.features.response_limit


def _continued(config: RLJobConfig) -> str | None:
    """What continues a row from its tokens so far (the whole row must fit), or None."""
    if config.features.multi_turn:
        return "tool turns (rl_config.multi_turn_enable) continue"
    if config.features.partial_rollout:
        return "partial rollout (rl_config.partial_rollout_max_split) continues"
    return None


def response_cut_warning(config: RLJobConfig) -> list[str]:
    """The warning line when vLLM stops a longest prompt's response at max_model_len."""
    key, prompt, what, response = _row(config)
    mml, short = config.generate_config.max_model_len, what.split(".")[-1]
    total = prompt + response
    if total <= mml or prompt >= mml or _continued(config):
        return []   # fits, or refused by check_lengths
    return [f"{what}={response}: {key}={prompt} + {short}={response} = {total} is larger than "
            f"generate_config.max_model_len={mml}: vLLM stops the response to a longest prompt "
            f"at max_model_len, {total - mml} tokens short of {short} (finish reason "
            f"\"length\"), as MindSpeed-RL runs it; set {short}: {mml - prompt} to say so, or "
            f"max_model_len: {total} for whole responses"]


def check_lengths(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first length or token budget that cannot hold the longest
    row (prompt + response)."""
    mt, rl, gen, sampling = (config.megatron_training, config.rl_config, config.generate_config,
                             config.sampling_config)
    prompt_key, prompt, what, response = _row(config)
    total = prompt + response
    require(prompt < gen.max_model_len, prompt_key, prompt,
            f"a longest prompt leaves no room for a response in generate_config.max_model_len="
            f"{gen.max_model_len}", f"lower {prompt_key.split('.')[-1]} to at most "
            f"{gen.max_model_len - 1} or raise generate_config.max_model_len to at least {total}")
    continued = _continued(config)
    require(total <= gen.max_model_len or continued is None, what, response,
            f"{prompt_key}={prompt} + {what.split('.')[-1]}={response} = {total} is larger than "
            f"generate_config.max_model_len={gen.max_model_len}, and {continued} a row from its "
            "tokens so far, which must all fit",
            f"lower {what.split('.')[-1]} to at most {gen.max_model_len - prompt} or raise "
            f"generate_config.max_model_len to at least {total}")
    # seq_length is the prompt data's length, as in MindSpeed-RL: a seq_length below
    # max_prompt_length cuts the longer prompts (the loader's warning says so).
    require(mt.seq_length <= gen.max_model_len, "megatron_training.seq_length", mt.seq_length,
            f"exceeds generate_config.max_model_len={gen.max_model_len} (MindSpeed-RL checks "
            "the same)", f"use at most {gen.max_model_len}")
    longest = longest_row(config)
    row = f"{prompt_key}={prompt} + {what}={response} = {total} tokens" + (
        f", cut at generate_config.max_model_len={longest}" if longest < total else "")
    if rl.use_dynamic_bsz:
        # The budget of each phase the job runs: its own key, else the base (as MindSpeed-RL
        # reads them); a role the algorithm does not build is not checked.
        for phase, prefix in packing_budgets(config).items():
            key = f"{prefix}max_packing_token_size" if getattr(
                rl, f"{prefix}max_packing_token_size") is not None else "max_packing_token_size"
            budget = getattr(rl, key)
            by = "" if key == f"{prefix}max_packing_token_size" else (
                f" (the {phase} phase's budget: rl_config.{prefix}max_packing_token_size is "
                "not set)")
            require(budget >= longest, f"rl_config.{key}", budget,
                    f"smaller than the longest single row{by}: {row} "
                    "(a micro-batch must hold at least one row)",
                    f"use at least {longest} (MindSpeed-RL suggests twice that, {2 * longest})")
        for prefix in ("", "update_", "actor_", "ref_"):
            key = f"{prefix}dynamic_max_batch_size"
            cap = getattr(rl, key)
            require(cap is None or cap > 0, f"rl_config.{key}", cap, "must be greater than 0",
                    "use a positive row count, or null for no cap")
    limit = config.model.max_position_embeddings
    require(limit is None or gen.max_model_len <= limit, "generate_config.max_model_len",
            gen.max_model_len, f"exceeds the model's max_position_embeddings={limit}",
            f"use at most {limit}")
    require(sampling.min_tokens <= response, "generate_config.sampling_config.min_tokens",
            sampling.min_tokens, f"exceeds max_tokens={response}", "set min_tokens <= max_tokens")
    batched = gen.max_num_batched_tokens
    require(batched is None or batched >= gen.max_num_seqs,
            "generate_config.max_num_batched_tokens", batched,
            f"smaller than generate_config.max_num_seqs={gen.max_num_seqs} (vLLM refuses this)",
            f"use at least {gen.max_num_seqs}, or null for vLLM's default")
