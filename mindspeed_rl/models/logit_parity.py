"""Logit parity of a megatron model against transformers: the pieces.

Every rank runs the same random token batch (`random_tokens`); the megatron logits
(`megatron_logits`: gathered over TP, from the last PP stage) are compared with
transformers' eager fp32 logits (`transformers_logits`) on the real vocabulary columns.
For a scalar-head model (reward model) the scores are compared with
``AutoModelForSequenceClassification``'s (`transformers_scores`), per position and pooled.
Loading a checkpoint and comparing it (tools/check_parity.py) is
mindspeed_rl/checkpoint/checkpoint_parity.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def random_tokens(vocab_size: int, batch_size: int, seq_length: int, seed: int = 0) -> torch.Tensor:
    """[batch, seq] token ids, identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_length), generator=g)


@torch.no_grad()
def megatron_forward(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """The model's output on the last PP stage (None elsewhere), through megatron's
    forward-only pipeline schedule, so it works at any PP size."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch_size, seq_length = tokens.shape
    position_ids = torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1)

    def forward_step(data_iterator, model):
        output = model(tokens, position_ids, attention_mask=None)

        def collect(output_tensor):
            return output_tensor.new_zeros(()), {"output": output_tensor.detach()}

        return output, collect

    model.eval()
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=batch_size, forward_only=True)
    return out[0]["output"] if ps.is_pipeline_last_stage() else None


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [batch, seq, padded_vocab] on the last PP stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    logits = megatron_forward(model, tokens)  # [b, s, vocab / tp]
    if logits is None:
        return None
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


@torch.no_grad()
def transformers_scores(hf_dir, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence classifier's (num_labels=1) scores: per position [batch, seq] and pooled
    at the last non-pad token [batch] (what transformers returns), fp32, eager attention."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    per_position = []
    handle = model.score.register_forward_hook(lambda module, args, out: per_position.append(out))
    try:
        pooled = model(input_ids=tokens).logits  # [b, 1]
    finally:
        handle.remove()
    return per_position[0].squeeze(-1), pooled.squeeze(-1)


def max_abs_diff_global(local: torch.Tensor | None) -> float:
    """max |x| over the ranks that hold x (the last PP stage), agreed on by every rank."""
    value = torch.tensor([float(local.abs().max()) if local is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())
