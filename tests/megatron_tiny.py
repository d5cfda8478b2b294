"""A tiny megatron-core GPT for the foundation tests (the real builders live in mindspeed_rl.models)."""

from __future__ import annotations

import torch

VOCAB = 128
SEQ = 16


def tiny_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def tiny_gpt(config=None, *, num_experts=None, pre_process=None, post_process=None, **overrides):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config or tiny_config(**overrides)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=config.normalization,
                                    qk_layernorm=config.qk_layernorm)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False)


def batch(batch_size=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(batch_size, -1)
    labels = torch.roll(tokens, -1, dims=1)
    return tokens, position_ids, labels
