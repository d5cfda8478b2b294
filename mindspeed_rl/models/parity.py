"""Logit parity of a megatron checkpoint against transformers on the HF weights.

Used by tools/check_parity.py and the parity tests. Every rank runs the same random
token batch; the megatron logits (gathered over TP, from the last PP stage) are
compared with transformers' eager fp32 logits on the real vocabulary columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def random_tokens(vocab_size: int, batch_size: int, seq_length: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=g)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, padded_vocab] on the last PP stage, None elsewhere.

    Runs megatron's forward-only pipeline schedule, so it works at any PP size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch_size, seq_length = tokens.shape
    position_ids = torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1)

    def forward_step(data_iterator, model):
        output = model(tokens, position_ids, attention_mask=None)  # [b, s, vocab / tp]

        def collect(output_tensor):
            return output_tensor.new_zeros(()), {"logits": output_tensor.detach()}

        return output, collect

    model.eval()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=batch_size, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = out[0]["logits"]
    tp_size = ps.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        shards = [torch.empty_like(logits) for _ in range(tp_size)]
        dist.all_gather(shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1)
    return logits


@torch.no_grad()
def transformers_logits(hf_dir, tokens: torch.Tensor) -> torch.Tensor:
    """Reference logits [batch, seq, vocab] from transformers (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    return model(input_ids=tokens).logits


def load_megatron_model(mg_dir, layout, *, seed: int = 1234):
    """Initialise megatron at ``layout`` and load ``mg_dir`` into this rank's shard.

    Returns (model, arch). Call `destroy_megatron_parallel()` when done.
    """
    from mindspeed_rl.checkpoint.megatron_dir import load_megatron_checkpoint
    from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config, describe_hf_dir
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    arch = describe_hf_dir(mg_dir)
    layout.check_model(num_attention_heads=arch.transformer_config_kwargs["num_attention_heads"],
                       num_query_groups=arch.transformer_config_kwargs["num_query_groups"],
                       num_layers=arch.num_layers, num_experts=arch.num_experts)
    initialize_megatron_parallel(layout, seed=seed)
    model = build_gpt_model(arch, build_transformer_config(arch))
    load_megatron_checkpoint(model, mg_dir)
    return model, arch


def max_abs_diff_global(local: torch.Tensor | None) -> float:
    """max |x| over the ranks that hold x (the last PP stage), agreed on by every rank."""
    value = torch.tensor([float(local.abs().max()) if local is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def check_parity(hf_dir, mg_dir, layout, *, seq_length: int = 32, batch_size: int = 2,
                 seed: int = 0, reference: torch.Tensor | None = None) -> float:
    """max |megatron logits - transformers logits| at ``layout`` (same value on every rank).

    ``reference`` reuses transformers logits computed earlier for the same tokens.
    """
    from megatron.core import parallel_state as ps

    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    model, arch = load_megatron_model(mg_dir, layout)
    try:
        tokens = random_tokens(arch.vocab_size, batch_size, seq_length, seed)
        logits = megatron_logits(model, tokens)
        diff = None
        if ps.is_pipeline_last_stage():
            ref = reference if reference is not None else transformers_logits(hf_dir, tokens)
            diff = logits[..., : arch.vocab_size] - ref
        return max_abs_diff_global(diff)
    finally:
        destroy_megatron_parallel()
