"""The trainer's log-probs at a sampling temperature against transformers'.

Used by ``tools/check_parity.py --temperature T``: a megatron checkpoint is loaded at a
layout, random prompt + response rows go through the same forward that computes old and
reference log-probs in training (vocabulary-parallel, padded vocabulary masked, logits /
T, any micro-batching), and each response token's log-prob is compared with
``log_softmax(transformers logits / T)`` on the HF weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def random_rows(vocab_size: int, seed: int, num_rows: int = 4, max_prompt: int = 12,
                max_response: int = 16):
    """Prompt and response token ids of several lengths, the same on every rank."""
    from mindspeed_rl.engine.micro_batches import RowBatch

    g = torch.Generator().manual_seed(seed)
    lengths = lambda top: torch.randint(1, top + 1, (num_rows,), generator=g).tolist()  # noqa: E731
    prompts = [torch.randint(0, vocab_size, (k + 1,), generator=g) for k in lengths(max_prompt)]
    responses = [torch.randint(0, vocab_size, (k,), generator=g) for k in lengths(max_response)]
    return RowBatch(prompts, responses, {})


@torch.no_grad()
def transformers_logprobs(hf_dir, batch, temperature: float) -> list[torch.Tensor]:
    """Per row: log_softmax(logits / T) of each response token, fp32 eager transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = []
    for prompt, response in zip(batch.prompts, batch.responses):
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0]  # [S, V]
        logp = torch.log_softmax(logits[len(prompt) - 1:-1].float() / temperature, dim=-1)
        out.append(logp.gather(1, response[:, None])[:, 0])
    return out


def check_logprob_parity(hf_dir, mg_dir, layout, *, temperature: float, seed: int = 0,
                         micro_batch_size: int = 2, packed: bool = False) -> float:
    """max |trainer log-prob at T - transformers log-prob at T| over every response token
    (the same value on every rank)."""
    from megatron.core import parallel_state as ps

    from mindspeed_rl.checkpoint.checkpoint_parity import load_megatron_model
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel
    from mindspeed_rl.engine.actor import forward_logprobs

    if temperature <= 0:
        raise ValueError(f"--temperature {temperature}: must be > 0 (greedy rollouts are "
                         "evaluated at 1)")
    model, arch = load_megatron_model(mg_dir, layout)
    try:
        batch = random_rows(arch.vocab_size, seed)
        spec = MicroBatching(micro_batch_size=micro_batch_size, packed=packed)
        ours, _ = forward_logprobs(model, batch, spec, arch.vocab_size, temperature=temperature)
        diff = 0.0
        if ps.is_pipeline_last_stage():
            theirs = transformers_logprobs(hf_dir, batch, temperature)
            diff = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
        value = torch.tensor([diff], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())
    finally:
        destroy_megatron_parallel()
