"""DPO's optimizer step on whole pairs (``mindspeed_rl/algorithms/dpo.py`` has the loss).

The rows come as pairs side by side: row ``2i`` the chosen response of pair ``i``, row
``2i + 1`` its rejected one, each with the reference's per-token log-probs
(``logprobs_ref``). Micro-batches keep each pair whole (``rows_per_unit=2``), so every
micro-batch computes its pairs' losses on its own; it returns their sum and the count
of its pairs, and megatron divides the gradients by the pairs of the whole step (every
DP rank): the mean over the batch's pairs whatever the micro-batching, as MindSpeed-LLM's
and TRL's ``losses.mean()`` over one batch.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.dpo import PairLogps, dpo_losses, sequence_logps, sft_term
from mindspeed_rl.engine.actor import response_logprobs, segment_ids
from mindspeed_rl.engine.micro_batches import MicroBatch, MicroBatching, RowBatch
from mindspeed_rl.engine.schedule import (micro_batches_for, reduce_sums_once_per_dp_rank,
                                           run_schedule)

PAIR = 2
# summed over pairs; each metric is its sum over the step's pairs / pairs
_SUM_KEYS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
             "rewards/margins", "logps/chosen", "logps/rejected", "sft_loss", "pairs"]


class PreferenceObjective:
    """The DPO loss of one micro-batch's logits, and the statistics it sums over the
    micro-batches of one optimizer step (TRL's metric names)."""

    def __init__(self, *, beta: float, loss_type: str, label_smoothing: float,
                 pref_ftx: float, vocab_size: int) -> None:
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.pref_ftx, self.vocab_size = pref_ftx, vocab_size
        self.sums: dict[str, float] = {}

    def pair_logps(self, logits, mb: MicroBatch) -> PairLogps:
        """The micro-batch's pairs: summed log-probs of policy and reference, lengths."""
        logp = response_logprobs(logits, mb, self.vocab_size)  # [b, R], the policy's
        seg, count = segment_ids(mb), len(mb.rows)
        policy, tokens = sequence_logps(logp, mb.mask, seg, count)
        ref, _ = sequence_logps(mb.extras["logprobs_ref"], mb.mask, seg, count)
        # the layout keeps the batch's order: chosen (even row), then its rejected one
        rows = torch.tensor(mb.rows)
        chosen = torch.nonzero(rows % PAIR == 0).flatten()
        if not torch.equal(rows[chosen] + 1, rows[chosen + 1]):
            raise RuntimeError(f"a micro-batch split a pair: rows {mb.rows}")
        return PairLogps(policy[chosen], policy[chosen + 1], ref[chosen], ref[chosen + 1],
                         tokens[chosen], tokens[chosen + 1])

    def loss(self, logits, mb: MicroBatch):
        """megatron's ``(loss, units, reported)``: the sum of the pairs' losses, their count."""
        x = self.pair_logps(logits, mb)
        losses, chosen, rejected = dpo_losses(x, self.beta, self.loss_type, self.label_smoothing)
        sft = sft_term(x)
        total = losses.sum() + (self.pref_ftx * sft.sum() if self.pref_ftx else 0.0)
        pairs = torch.tensor(float(len(losses)))
        for key, value in (("loss", total), ("rewards/chosen", chosen.sum()),
                           ("rewards/rejected", rejected.sum()),
                           ("rewards/accuracies", (chosen > rejected).float().sum()),
                           ("rewards/margins", (chosen - rejected).sum()),
                           ("logps/chosen", x.policy_chosen.sum()),
                           ("logps/rejected", x.policy_rejected.sum()),
                           ("sft_loss", sft.sum()), ("pairs", pairs)):
            self.sums[key] = self.sums.get(key, 0.0) + float(value.detach())
        return total, pairs.to(torch.int), {"loss": total.detach().clone()}

    def reduced(self) -> dict[str, float]:
        """The step's statistics over every DP rank, per pair."""
        totals = reduce_sums_once_per_dp_rank(self.sums, _SUM_KEYS)
        pairs = max(totals.pop("pairs"), 1.0)
        stats = {k: v / pairs for k, v in totals.items()}
        stats["pairs"] = pairs
        return stats


def preference_step(actor, batch: RowBatch, micro_batching: "int | MicroBatching",
                    objective: PreferenceObjective) -> dict[str, float]:
    """One optimizer step of ``actor`` on ``batch`` (this DP rank's whole pairs, chosen
    before rejected, with their ``logprobs_ref``); returns the step's statistics."""
    micro = micro_batches_for(actor.model, batch, micro_batching, rows_per_unit=PAIR)
    out = actor.step(lambda: run_schedule(actor.ddp, actor.model, micro, objective.loss,
                                          forward_only=False),
                     objective.sums.values)
    actor.weight_version += int(out["update_ok"])
    stats = objective.reduced()
    stats.update(out)
    return stats
