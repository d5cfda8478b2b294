"""Rollout parity: after resharding, vLLM generates with exactly the trainer's weights.

vLLM greedily continues a few prompts; megatron (in the training sharding)
recomputes the log-prob of every generated token; the largest difference is
agreed on by all ranks. Used by ``tools/check_parity.py --rollout`` and tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_rl.models.logit_parity import max_abs_diff_global, megatron_logits
from mindspeed_rl.config.schema import SamplingConfig
from mindspeed_rl.rollout import RolloutEngine


@torch.no_grad()
def megatron_response_logprobs(model, prompt: list[int], response: list[int],
                               vocab_size: int, temperature: float = 1.0) -> torch.Tensor | None:
    """log p(response_t | prefix) [len(response)] of the policy at ``temperature``
    (log_softmax(logits / T)) from megatron, on the last PP stage."""
    tokens = torch.tensor([prompt + response])
    logits = megatron_logits(model, tokens)
    if logits is None:
        return None
    logp = torch.log_softmax(logits[0, :, :vocab_size].float() / temperature, dim=-1)  # [s, V]
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def rollout_parity(model, arch, resharder, engine: RolloutEngine, prompts: list[list[int]],
                   max_tokens: int = 8, temperature: float = 0.0,
                   seed: int = 0) -> tuple[list[list[int]], float]:
    """Reshard into ``engine``, generate (greedy, or sampled at ``temperature`` with one
    seed per prompt), recompute each token's log-prob with megatron at that temperature.

    Returns (responses per prompt, max |logprob_vllm - logprob_megatron|).
    Leaves the actor in the training sharding.
    """
    resharder.to_infer()
    sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens)
    result = engine.generate(prompts, n=1, sampling=sampling,
                             seeds=[seed + i for i in range(len(prompts))])
    resharder.to_train()
    responses, diffs = [], []
    for prompt, group in zip(prompts, result.completions):
        completion = group[0]
        responses.append(completion.token_ids)
        ours = megatron_response_logprobs(model, prompt, completion.token_ids, arch.vocab_size,
                                          sampling.policy_temperature)
        if ours is not None:
            diffs.append((ours - torch.tensor(completion.logprobs)).abs().max())
    local = torch.stack(diffs).max() if diffs else None
    return responses, max_abs_diff_global(local)


def same_on_all_ranks(obj) -> bool:
    """True when every rank holds an equal ``obj`` (e.g. TP_g peers' greedy outputs)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return all(o == everyone[0] for o in everyone)


def check_rollout_parity(hf_dir, mg_dir, layout, *, num_prompts: int = 4, prompt_length: int = 8,
                         max_tokens: int = 16, bucket_mb: float = 64, seed: int = 0,
                         temperature: float = 0.0) -> float:
    """Load ``mg_dir`` at ``layout``, reshard into a vLLM engine started from ``hf_dir``'s
    config with dummy weights, generate (greedy, or sampled at ``temperature``) and return
    max |logprob_vllm - logprob_megatron| for the policy at that temperature."""
    from mindspeed_rl.checkpoint.checkpoint_parity import load_megatron_model
    from mindspeed_rl.models.logit_parity import random_tokens
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.resharding.resharder import Resharder

    platform = setup_platform()
    model, arch = load_megatron_model(mg_dir, layout)
    try:
        engine = RolloutEngine(hf_dir, infer_tensor_parallel_size=layout.infer_tensor_parallel_size,
                               max_model_len=prompt_length + max_tokens + 8, max_num_seqs=num_prompts,
                               load_format="dummy", gpu_memory_utilization=0.02,
                               device_type=platform.device_type)
        resharder = Resharder(model=model, model_chunks=[model], optimizer=None, engine=engine,
                              weight_map=arch.weight_map, bucket_bytes=int(bucket_mb * 2**20),
                              platform=platform)
        prompts = random_tokens(arch.vocab_size, num_prompts, prompt_length, seed).tolist()
        _, diff = rollout_parity(model, arch, resharder, engine, prompts, max_tokens,
                                 temperature=temperature, seed=seed)
        engine.shutdown()
        return diff
    finally:
        destroy_megatron_parallel()
