"""Log-probabilities of target tokens from logits, full-vocabulary and vocab-parallel.

log p(y) = z_y - logsumexp(z), computed in float32. The logits given are those of
the distribution meant: a policy that samples at temperature T passes z / T (the
trainer does, in ``mindspeed_rl/engine/actor.py``'s ``policy_logits``), so that
training and rollout log-probs describe the same distribution.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.entropy import AllReduce


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets].

    logits: [batch, seq, vocab]; targets: [batch, seq] (int64) -> [batch, seq] float32
    """
    logits = logits.float()
    target_logits = logits.gather(dim=-1, index=targets.long().unsqueeze(-1)).squeeze(-1)
    return target_logits - torch.logsumexp(logits, dim=-1)


def logprobs_from_vocab_parallel_logits(logits_shard: torch.Tensor, targets: torch.Tensor,
                                        vocab_start: int, all_reduce_max: AllReduce,
                                        all_reduce_sum: AllReduce) -> torch.Tensor:
    """log p(targets) when each rank holds the vocabulary slice
    [vocab_start, vocab_start + vocab_per_rank).

    With the global max m, S = sum over all shards of exp(z_v - m), and
    z_y - m contributed only by the shard that holds the target (0 elsewhere):
        log p(y) = (z_y - m) - log S
    Both sums travel in one ``all_reduce_sum`` call.

    logits_shard: [batch, seq, vocab_per_rank]; targets: [batch, seq] global token ids
    all_reduce_max / all_reduce_sum: as in ``entropy_from_vocab_parallel_logits``
      (the sum must be autograd-aware, identity backward, for gradients).
    returns: [batch, seq] float32, identical on every rank.
    """
    logits_shard = logits_shard.float()
    vocab_per_rank = logits_shard.shape[-1]
    global_max = all_reduce_max(logits_shard.detach().max(dim=-1).values)  # [batch, seq]
    shifted = logits_shard - global_max.unsqueeze(-1)  # [batch, seq, vocab_per_rank]
    local_ids = targets.long() - vocab_start  # [batch, seq]
    in_shard = (local_ids >= 0) & (local_ids < vocab_per_rank)
    # Out-of-shard targets gather a valid dummy index and are zeroed afterwards.
    safe_ids = torch.where(in_shard, local_ids, torch.zeros_like(local_ids))
    target_shifted = shifted.gather(dim=-1, index=safe_ids.unsqueeze(-1)).squeeze(-1)
    target_shifted = target_shifted * in_shard.to(target_shifted.dtype)
    local = torch.stack([torch.exp(shifted).sum(dim=-1), target_shifted], dim=-1)
    summed = all_reduce_sum(local)  # [batch, seq, 2]
    return summed[..., 1] - torch.log(summed[..., 0])
