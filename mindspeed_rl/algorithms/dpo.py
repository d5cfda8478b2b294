"""The DPO family (``pretrain_dpo.py``; MindSpeed-RL's ``stage: dpo``) and its loss.

Direct preference optimization (arXiv 2305.18290) trains on pairs of responses to one
prompt, one preferred (chosen) and one not (rejected), against a frozen reference: no
rollout, no reward. With the sequence log-probs ``pi_c, pi_r`` of the policy and
``ref_c, ref_r`` of the reference (sums over each response's tokens; IPO: means),

    logits = (pi_c - pi_r) - (ref_c - ref_r)

and the loss per pair is, by ``dpo_loss_type`` (MindSpeed-LLM's ``DPOTrainer`` and TRL's
``DPOTrainer`` agree on these):

    sigmoid  -(1 - ls) log sigma(beta logits) - ls log sigma(-beta logits)   (ls: label smoothing, cDPO)
    hinge    max(0, 1 - beta logits)                                          (SLiC)
    ipo      (logits - 1 / (2 beta))^2, on length-averaged log-probs           (IPO, eq. 17)

The implicit rewards are ``beta (pi - ref)`` of each response; ``pref_ftx`` adds that
coefficient times the chosen response's negative mean log-prob (an SFT term). Pure
tensor functions: the trainer sums them over its micro-batches and DP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed_rl.algorithms import phase_names as p
from mindspeed_rl.algorithms.family import Algorithm
from mindspeed_rl.algorithms.registry import register

DPO = register(Algorithm(
    name="dpo", launcher="pretrain_dpo.py", stages=("dpo",),
    phases=(p.PAIRS, p.REFERENCE_MODEL, p.PREFERENCE_UPDATE),
    default_estimator=None, always=frozenset({"reference", "pairs"}),
))

# dpo_loss_type -> whether it reads length-averaged log-probs (as both trainers do for IPO)
LOSS_TYPES = {"sigmoid": False, "hinge": False, "ipo": True}


@dataclass(frozen=True)
class PairLogps:
    """Per pair ``[pairs]``: the sequence log-probs of the chosen and rejected responses
    under the policy and the reference, and the response lengths (tokens)."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def averaged(self) -> "PairLogps":
        """The same pairs with each log-prob divided by its response's length."""
        c, r = self.chosen_tokens.clamp(min=1), self.rejected_tokens.clamp(min=1)
        return PairLogps(self.policy_chosen / c, self.policy_rejected / r, self.ref_chosen / c,
                         self.ref_rejected / r, self.chosen_tokens, self.rejected_tokens)


def dpo_losses(x: PairLogps, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each ``[pairs]``. ``x`` holds summed
    log-probs; IPO averages them over each response's tokens first (``LOSS_TYPES``)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo_loss_type={loss_type!r} is not one of {sorted(LOSS_TYPES)}")
    if LOSS_TYPES[loss_type]:
        x = x.averaged()
    logits = (x.policy_chosen - x.policy_rejected) - (x.ref_chosen - x.ref_rejected)
    if loss_type == "sigmoid":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (x.policy_chosen - x.ref_chosen).detach()
    rejected_rewards = beta * (x.policy_rejected - x.ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def sft_term(x: PairLogps) -> torch.Tensor:
    """``[pairs]``: the chosen response's negative mean log-prob (``pref_ftx``'s term)."""
    return -x.policy_chosen / x.chosen_tokens.clamp(min=1)


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor,
                   num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob, token count) of each of ``num_rows`` rows, ``[num_rows]`` each:
    ``token_logps``/``mask``/``segments`` are ``[b, R]`` with ``segments`` naming the row
    (0 .. num_rows - 1) of every position (any value where ``mask`` is 0)."""
    seg = torch.where(mask > 0, segments, torch.zeros_like(segments)).reshape(-1)
    sums = torch.zeros(num_rows, dtype=token_logps.dtype, device=token_logps.device)
    sums = sums.index_add(0, seg, (token_logps * mask).reshape(-1))
    counts = torch.zeros(num_rows, dtype=mask.dtype, device=mask.device)
    counts = counts.index_add(0, seg, mask.reshape(-1))
    return sums, counts
