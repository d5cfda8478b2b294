"""Token entropy of the policy from logits, full-vocabulary and vocab-parallel.

H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v   (z: logits, p = softmax(z))

The second form needs no log of small probabilities and is what we compute, in
float32. The vocab-parallel variant computes the same quantity when each
tensor-parallel rank holds a slice of the vocabulary; the reductions across the
slices are passed in (the trainer passes Megatron's TP all-reduces), so this
module never touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension.

    logits: [batch, seq, vocab] -> [batch, seq] (float32)
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_from_vocab_parallel_logits(logits_shard: torch.Tensor, all_reduce_max: AllReduce,
                                       all_reduce_sum: AllReduce) -> torch.Tensor:
    """Entropy of the full softmax when each rank holds a vocabulary shard.

    With the global max m (shift for stability; entropy is shift-invariant, so m
    carries no gradient), S = sum_v exp(z_v - m) and
    T = sum_v exp(z_v - m) (z_v - m), both summed over all shards:
        H = log S - T / S

    logits_shard: [batch, seq, vocab_per_rank]
    all_reduce_max / all_reduce_sum: take a tensor and return its elementwise max /
      sum over the tensor-parallel ranks (out of place or in place, the result is
      what is used). For gradients through the entropy, ``all_reduce_sum`` must be
      autograd-aware with an identity backward, e.g. Megatron's
      ``reduce_from_tensor_model_parallel_region``; the max is called on a
      detached tensor. S and T travel in one call.
    returns: [batch, seq] (float32), identical on every rank.
    """
    logits_shard = logits_shard.float()
    global_max = all_reduce_max(logits_shard.detach().max(dim=-1).values)  # [batch, seq]
    shifted = logits_shard - global_max.unsqueeze(-1)  # [batch, seq, vocab_per_rank]
    exp_shifted = torch.exp(shifted)
    local = torch.stack([exp_shifted.sum(dim=-1), (exp_shifted * shifted).sum(dim=-1)], dim=-1)
    summed = all_reduce_sum(local)  # [batch, seq, 2]
    sum_exp, sum_exp_times_logit = summed[..., 0], summed[..., 1]
    return torch.log(sum_exp) - sum_exp_times_logit / sum_exp
