"""DPO's loss per type against TRL's DPOTrainer formulas, written out here in scalar math on
fixed numbers (TRL's ``dpo_loss``: sigmoid with label smoothing, hinge, IPO on
length-averaged log-probs; its rewards beta * (policy - reference)); and the engine's
pairing of rows inside a micro-batch (chosen even, rejected odd)."""

import math

import pytest
import torch

from mindspeed_rl.algorithms.dpo import PairLogps, dpo_losses, sequence_logps, sft_term

# two pairs: summed log-probs of policy / reference, response lengths
PC, PR = [-12.0, -30.5], [-15.0, -29.0]
RC, RR = [-13.5, -31.0], [-14.0, -30.0]
LC, LR = [4, 10], [6, 8]


def _pairs() -> PairLogps:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return PairLogps(t(PC), t(PR), t(RC), t(RR), t(LC), t(LR))


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z))


def _trl(loss_type: str, beta: float, ls: float = 0.0) -> tuple[list, list, list]:
    """TRL's DPOTrainer.dpo_loss, one pair at a time."""
    losses, chosen, rejected = [], [], []
    for i in range(2):
        pc, pr, rc, rr = PC[i], PR[i], RC[i], RR[i]
        if loss_type == "ipo":  # TRL: IPO reads the average log-prob of each response
            pc, pr, rc, rr = pc / LC[i], pr / LR[i], rc / LC[i], rr / LR[i]
        logits = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            loss = -_log_sigmoid(beta * logits) * (1 - ls) - _log_sigmoid(-beta * logits) * ls
        elif loss_type == "hinge":
            loss = max(0.0, 1 - beta * logits)
        else:
            loss = (logits - 1 / (2 * beta)) ** 2
        losses.append(loss)
        chosen.append(beta * (pc - rc))
        rejected.append(beta * (pr - rr))
    return losses, chosen, rejected


@pytest.mark.parametrize("loss_type,beta,ls", [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2),
                                               ("hinge", 0.1, 0.0), ("hinge", 2.0, 0.0),
                                               ("ipo", 0.1, 0.0), ("ipo", 0.7, 0.0)])
def test_each_loss_type_equals_trls_formula(loss_type, beta, ls):
    losses, chosen, rejected = dpo_losses(_pairs(), beta, loss_type, ls)
    want_losses, want_chosen, want_rejected = _trl(loss_type, beta, ls)
    assert losses.tolist() == pytest.approx(want_losses, rel=1e-12, abs=1e-12)
    assert chosen.tolist() == pytest.approx(want_chosen, rel=1e-12)
    assert rejected.tolist() == pytest.approx(want_rejected, rel=1e-12)


def test_the_numbers_are_the_expected_ones_and_hinge_clamps():
    """Fixed values by hand: pair 0 logits = (3) - (0.5) = 2.5, pair 1 = (-1.5) - (-1) = -0.5."""
    losses, chosen, rejected = dpo_losses(_pairs(), 1.0, "sigmoid")
    assert losses[0].item() == pytest.approx(math.log1p(math.exp(-2.5)))
    assert losses[1].item() == pytest.approx(math.log1p(math.exp(0.5)))
    hinge, _, _ = dpo_losses(_pairs(), 1.0, "hinge")
    assert hinge.tolist() == pytest.approx([0.0, 1.5])  # relu(1 - 2.5) = 0
    assert (chosen > rejected).tolist() == [True, False]


def test_the_gradient_pushes_chosen_up_and_rejected_down():
    x = _pairs()
    pc = x.policy_chosen.clone().requires_grad_(True)
    pr = x.policy_rejected.clone().requires_grad_(True)
    y = PairLogps(pc, pr, x.ref_chosen, x.ref_rejected, x.chosen_tokens, x.rejected_tokens)
    for loss_type in ("sigmoid", "hinge", "ipo"):
        pc.grad = pr.grad = None
        dpo_losses(y, 0.1, loss_type)[0].sum().backward()
        assert (pc.grad < 0).all() and (pr.grad > 0).all(), loss_type


def test_unknown_loss_type_is_refused_by_name():
    with pytest.raises(ValueError, match="dpo_loss_type='kto'"):
        dpo_losses(_pairs(), 0.1, "kto")


def test_sft_term_is_the_chosen_mean_negative_logprob():
    assert sft_term(_pairs()).tolist() == pytest.approx([12.0 / 4, 30.5 / 10])


def test_sequence_logps_sums_each_rows_tokens_in_a_packed_layout():
    """A packed micro-batch: rows 0, 1, 2 follow each other along R; padding masked."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.25, -4.0, -8.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    seg = torch.tensor([[0, 0, 1, 1, 1, 2, 0]])
    sums, counts = sequence_logps(logp, mask, seg, 3)
    assert sums.tolist() == [-3.0, -0.75, -8.0]
    assert counts.tolist() == [2.0, 2.0, 1.0]
