"""Scalar-head roles: the PPO critic (trained) and the reward model (frozen).

Both are megatron GPT models whose output layer is a scalar head
(``mindspeed_rl.models.value_head``). The critic predicts, at the position
before each response token, the value of the state; the reward model scores a
whole response at its last token.
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms import explained_variance, masked_sum, value_loss
from mindspeed_rl.engine.micro_batches import MicroBatch, MicroBatching, RowBatch
from mindspeed_rl.engine.optim import TrainableModel
from mindspeed_rl.engine.schedule import (forward_rows, micro_batches_for,
                                           reduce_sums_once_per_dp_rank, run_schedule)

_STAT_KEYS = ["vf_loss", "vf_clipfrac", "vpred", "returns", "returns_sq", "residual",
              "residual_sq", "tokens"]


def _scalar(outputs: torch.Tensor) -> torch.Tensor:
    """The head's outputs at the response positions, [b, R] float32."""
    return outputs.float()


class MegatronCritic(TrainableModel):
    """The PPO value model: ``values`` of the response positions, trained on GAE returns."""

    def update(self, batch: RowBatch, micro_batch_size: int | MicroBatching, *,
               cliprange_value: float) -> dict[str, float]:
        """One optimizer step of the clipped value loss on ``batch`` (this DP rank's share of
        a mini-batch; ``extras``: ``values`` at rollout time and ``returns``). Token mean
        over the whole mini-batch, as the actor's loss."""
        sums: dict[str, float] = {}

        def loss_fn(outputs, mb: MicroBatch):
            vpred = _scalar(outputs)
            mask = mb.mask
            loss, stats = value_loss(vpred, mb.extras["values"], mb.extras["returns"], mask,
                                     cliprange_value, "token-mean", num_tokens_global=1.0)
            n = mask.sum()
            residual = (mb.extras["returns"] - vpred.detach()) * mask
            returns = mb.extras["returns"] * mask
            for key, value in (("vf_loss", loss), ("vf_clipfrac", stats["vf_clipfrac"] * n),
                               ("vpred", masked_sum(vpred.detach(), mask)),
                               ("returns", returns.sum()), ("returns_sq", returns.square().sum()),
                               ("residual", residual.sum()),
                               ("residual_sq", residual.square().sum()), ("tokens", n)):
                sums[key] = sums.get(key, 0.0) + float(value.detach())
            return loss, n.to(torch.int), {"loss": loss.detach().clone()}

        micro = micro_batches_for(self.model, batch, micro_batch_size)  # docs/micro_batches.md
        out = self.step(lambda: run_schedule(self.ddp, self.model, micro, loss_fn,
                                             forward_only=False), sums.values)
        t = reduce_sums_once_per_dp_rank(sums, _STAT_KEYS)
        n = max(t["tokens"], 1.0)
        return {"vf_loss": t["vf_loss"] / n, "vf_clipfrac": t["vf_clipfrac"] / n,
                "vpred_mean": t["vpred"] / n,
                # how much of the returns the critic explains (NaN when they do not vary)
                "explained_variance": explained_variance(
                    t["returns"], t["returns_sq"], t["residual"], t["residual_sq"],
                    t["tokens"]),
                **out}


def forward_values(model, batch: RowBatch, micro_batch_size: int | MicroBatching
                   ) -> list[torch.Tensor]:
    """The critic's value before each response token: ``[R_i]`` per row."""
    return forward_rows(model, batch, micro_batch_size, ("values",),
                        lambda outputs, mb: (_scalar(outputs),))["values"]


def forward_scores(model, batch: RowBatch, micro_batch_size: int | MicroBatching
                   ) -> list[torch.Tensor]:
    """The reward model's score of each whole response: its output at the last response
    token (the position a sequence classifier reads), ``[]`` per row (0 for an empty one)."""
    # Outputs at positions P .. P+R-1 (after each response token): the response positions
    # shifted by one; the last real one is the sequence's last token.
    outputs = forward_rows(model, batch, micro_batch_size, ("after",),
                           lambda outputs, mb: (_scalar(outputs),), position_shift=1)["after"]
    return [o[-1].clone() if len(o) else torch.zeros(()) for o in outputs]
