"""Rows of (prompt, response) and the padded micro-batches megatron runs.

A :class:`RowBatch` is one DP rank's rows as the TransferDock delivers them
(variable lengths, no padding). :func:`make_micro_batches` pads them into the
equal-shape micro-batches megatron's pipeline schedule needs; per-row extras
(log-probs, advantages, values, ...) are padded alongside, and a response mask
marks the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowBatch:
    """Rows of (prompt ids, response ids) plus per-row extra tensors (one DP rank's share)."""

    prompts: list[torch.Tensor]  # each [P_i] int64
    responses: list[torch.Tensor]  # each [R_i] int64
    extras: dict[str, list[torch.Tensor]]  # e.g. logprobs_old: each [R_i]; rewards: []

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, S] prompt+response, right-padded
    positions: torch.Tensor  # [b, S]
    response_index: torch.Tensor  # [b, R] position whose output predicts response token t
    response_ids: torch.Tensor  # [b, R]
    mask: torch.Tensor  # [b, R] float, 1 on real response tokens
    extras: dict[str, torch.Tensor]  # [b, R] (per token) or [b, 1] broadcast to [b, R]
    num_real_rows: int


def make_micro_batches(batch: RowBatch, micro_batch_size: int, pad_id: int = 0) -> list[MicroBatch]:
    """Pad rows into equal-shape micro-batches (the pipeline schedule needs one shape).

    Every micro-batch has ``micro_batch_size`` rows (missing rows are empty, mask 0)
    and the same sequence length S = max(P_i + R_i) over the batch.
    """
    seq_len = max((len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)), default=1)
    resp_len = max((len(r) for r in batch.responses), default=1)
    out = []
    for start in range(0, max(len(batch), 1), micro_batch_size):
        idx = list(range(start, min(start + micro_batch_size, len(batch))))
        b = micro_batch_size
        tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
        response_ids = torch.full((b, resp_len), pad_id, dtype=torch.long)
        response_index = torch.zeros((b, resp_len), dtype=torch.long)
        mask = torch.zeros((b, resp_len))
        extras = {k: torch.zeros((b, resp_len)) for k in batch.extras}
        for row, i in enumerate(idx):
            p, r = batch.prompts[i], batch.responses[i]
            tokens[row, :len(p)] = p
            tokens[row, len(p):len(p) + len(r)] = r
            response_ids[row, :len(r)] = r
            # the output at position t predicts token t+1
            response_index[row, :len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
            mask[row, :len(r)] = 1.0
            for k, values in batch.extras.items():
                v = values[i].float()
                extras[k][row, :len(r)] = v if v.numel() == len(r) else v.expand(len(r))
        positions = torch.arange(seq_len).unsqueeze(0).expand(b, -1)
        out.append(MicroBatch(tokens, positions, response_index, response_ids, mask, extras, len(idx)))
    return out
