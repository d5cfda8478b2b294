"""Logit parity of a megatron checkpoint against transformers on the HF weights.

Used by tools/check_parity.py and the parity tests: `load_megatron_model` loads the
checkpoint at a parallel layout, `check_parity` compares its logits (or, for a scalar-head
checkpoint, its scores) with transformers' through the pieces of
mindspeed_rl/models/logit_parity.py.
"""

from __future__ import annotations

import torch

from mindspeed_rl.models.logit_parity import (max_abs_diff_global, megatron_forward,
                                              megatron_logits, random_tokens, transformers_logits,
                                              transformers_scores)


def load_megatron_model(mg_dir, layout, *, seed: int = 1234, num_layer_list: str | None = None):
    """Initialise megatron at ``layout`` and load ``mg_dir`` into this rank's shard
    (``num_layer_list``: uneven pipeline stages, MindSpeed-LLM's key, e.g. "1,2").

    Returns (model, arch). A checkpoint with a scalar head (a converted reward model, a
    critic) gives a `value_head.GPTValueModel`. Call `destroy_megatron_parallel()` when done.
    """
    from mindspeed_rl.checkpoint.megatron_dir import checkpoint_tensor_keys, load_megatron_checkpoint
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config, describe_hf_dir
    from mindspeed_rl.models.training_options import stage_layer_options
    from mindspeed_rl.models.value_head import VALUE_HEAD, build_value_model
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    arch = describe_hf_dir(mg_dir)
    layout.check_model(num_attention_heads=arch.transformer_config_kwargs["num_attention_heads"],
                       num_query_groups=arch.transformer_config_kwargs["num_query_groups"],
                       num_layers=arch.num_layers, num_experts=arch.num_experts,
                       num_layer_list=num_layer_list)
    scalar_head = VALUE_HEAD in checkpoint_tensor_keys(mg_dir)
    initialize_megatron_parallel(layout, seed=seed)
    build = build_value_model if scalar_head else build_gpt_model
    stages = stage_layer_options(arch.num_layers, layout.pipeline_model_parallel_size, num_layer_list)
    model = build(arch, build_transformer_config(arch, **stages))
    load_megatron_checkpoint(model, mg_dir)
    return model, arch


def check_parity(hf_dir, mg_dir, layout, *, seq_length: int = 32, batch_size: int = 2,
                 seed: int = 0, reference: torch.Tensor | None = None) -> float:
    """max |megatron logits - transformers logits| at ``layout`` (same value on every rank).

    ``reference`` reuses transformers logits computed earlier for the same tokens. For a
    scalar-head checkpoint the logits are the sequence classifier's scores: per position
    and pooled at the last non-pad token.
    """
    from megatron.core import parallel_state as ps

    from mindspeed_rl.models import value_head
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    model, arch = load_megatron_model(mg_dir, layout)
    try:
        tokens = random_tokens(arch.vocab_size, batch_size, seq_length, seed)
        if isinstance(model, value_head.GPTValueModel):
            values = megatron_forward(model, tokens)  # [b, s]
            diff = None
            if values is not None:
                per_position, pooled = transformers_scores(hf_dir, tokens)
                pad = arch.hf_config.pad_token_id
                diff = torch.cat([(values - per_position).flatten(),
                                  value_head.last_token_values(values, tokens, pad) - pooled])
            return max_abs_diff_global(diff)
        logits = megatron_logits(model, tokens)
        diff = None
        if ps.is_pipeline_last_stage():
            ref = reference if reference is not None else transformers_logits(hf_dir, tokens)
            diff = logits[..., : arch.vocab_size] - ref
        return max_abs_diff_global(diff)
    finally:
        destroy_megatron_parallel()
