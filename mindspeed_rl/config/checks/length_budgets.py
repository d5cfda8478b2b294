"""Checks of the sequence lengths and the token budgets.

The longest row (``max_prompt_length`` + the response limit) fits vLLM's ``max_model_len``,
which fits the model's positions; ``seq_length``, ``min_tokens`` and vLLM's batched tokens
agree; with ``use_dynamic_bsz`` each micro-batch phase's packing budget
(`config/batch_plan.py`'s `packing_budgets`) holds the longest row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mindspeed_rl.config.batch_plan import packing_budgets
from mindspeed_rl.config.config_error import require

if TYPE_CHECKING:
    from mindspeed_rl.config.schema import RLJobConfig


def check_lengths(config: RLJobConfig) -> None:
    """Raise `ConfigError` for the first length or token budget that cannot hold the longest
    row (prompt + response)."""
    mt, rl, gen, sampling = (config.megatron_training, config.rl_config, config.generate_config,
                             config.sampling_config)
    prompt, response = rl.max_prompt_length, config.features.response_limit
    total = prompt + response
    what = ("rl_config.max_total_response_length" if config.features.multi_turn
            else "generate_config.sampling_config.max_tokens")
    require(total <= gen.max_model_len, what, response,
            f"rl_config.max_prompt_length={prompt} + {what.split('.')[-1]}={response} = {total} "
            "is larger "
            f"than generate_config.max_model_len={gen.max_model_len}",
            (f"lower max_tokens to at most {gen.max_model_len - prompt} or raise "
             if gen.max_model_len > prompt else "lower rl_config.max_prompt_length or raise ")
            + f"generate_config.max_model_len to at least {total}")
    # seq_length is the prompt data's length, as in MindSpeed-RL: a seq_length below
    # max_prompt_length cuts the longer prompts (the loader's warning says so).
    require(mt.seq_length <= gen.max_model_len, "megatron_training.seq_length", mt.seq_length,
            f"exceeds generate_config.max_model_len={gen.max_model_len} (MindSpeed-RL checks "
            "the same)", f"use at most {gen.max_model_len}")
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
            require(budget >= total, f"rl_config.{key}", budget,
                    f"smaller than the longest single row{by}: rl_config.max_prompt_length="
                    f"{prompt} + {what}={response} = {total} tokens "
                    "(a micro-batch must hold at least one row)",
                    f"use at least {total} (MindSpeed-RL suggests twice that, {2 * total})")
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
