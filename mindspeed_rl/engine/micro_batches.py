"""Rows of (prompt, response) and the micro-batches megatron runs.

A :class:`RowBatch` is one DP rank's rows as the TransferDock delivers them
(variable lengths, no padding). How they become micro-batches is a
:class:`MicroBatching` (one per phase, from ``rl_config``):

* fixed (the default): ``micro_batch_size`` rows per micro-batch, every
  micro-batch padded to the longest prompt + response of the whole batch;
* token budget (``use_dynamic_bsz``): rows grouped by length so that each
  micro-batch holds at most ``max_tokens`` tokens and about the same number as
  the others; each micro-batch is padded to its own longest row;
* packed (``use_remove_padding``): the rows of a micro-batch are concatenated
  into one sequence (each attends only to itself, positions restart per row):
  no padding at all.

:func:`plan_micro_batches` is the pure planning (row lengths in, groups of row
indices out); the DP ranks must run the same number of micro-batches, so the
caller agrees on ``count`` first (``mindspeed_rl.engine.schedule``).
:func:`build_micro_batch` lays one group out; per-row extras (log-probs,
advantages, values, ...) are laid out alongside and a response mask marks the
real tokens, so a loss written for ``[b, R]`` tensors works for every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from mindspeed_rl.config.batch_plan import MicroBatching

# A per-token row extra of 1s and 0s: the response tokens the loss covers (multi-turn's
# ``response_mask`` column); the micro-batch's ``mask`` is 0 where it is 0.
LOSS_MASK = "response_mask"
# A per-row extra ``[T, L, k]`` (T = prompt + response - 1 tokens): the experts each token
# was routed to in each MoE layer (``algorithms/routing.py``); laid out along the sequence
# as ``MicroBatch.routing``, not along the response.
ROUTING = "routed_experts"

__all__ = ["LOSS_MASK", "ROUTING", "MicroBatch", "MicroBatching", "RowBatch", "build_micro_batch", "make_micro_batches",
           "min_micro_batches", "plan_micro_batches", "unit_lengths"]

@dataclass
class RowBatch:
    """Rows of (prompt ids, response ids) plus per-row extra tensors (one DP rank's share)."""

    prompts: list[torch.Tensor]  # each [P_i] int64
    responses: list[torch.Tensor]  # each [R_i] int64
    extras: dict[str, list[torch.Tensor]]  # e.g. logprobs_old: each [R_i]; rewards: []

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths(self) -> list[int]:
        """Prompt + response tokens of every row."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]


@dataclass
class MicroBatch:
    """One micro-batch laid out for megatron: ``b`` sequences of ``S`` tokens.

    ``response_index[j, t]`` is the position (in sequence ``j``) whose output
    predicts response token ``response_ids[j, t]``; ``mask`` marks the real ones.
    Padded, sequence ``j`` is row ``rows[j]``; packed (``segments`` not None),
    ``b`` is 1 and the rows' responses follow each other along ``R``.
    ``spans[k] = (j, start, length)`` locates row ``rows[k]``'s response in the
    ``[b, R]`` tensors.
    """

    tokens: torch.Tensor  # [b, S] prompt+response, right-padded
    positions: torch.Tensor  # [b, S] (packed: restarting at 0 for every row)
    response_index: torch.Tensor  # [b, R] position whose output predicts response token t
    response_ids: torch.Tensor  # [b, R]
    mask: torch.Tensor  # [b, R] float, 1 on real response tokens the loss covers
    extras: dict[str, torch.Tensor]  # [b, R] (per token) or [b, 1] broadcast to [b, R]
    num_real_rows: int
    rows: list[int]  # indices into the RowBatch, in layout order
    spans: list[tuple[int, int, int]]  # per row: (sequence, start in R, response length)
    segments: list[int] | None = None  # packed: lengths of the rows in the one sequence
    row_lengths: list[tuple[int, int]] | None = None  # per row: (prompt, response) tokens
    num_tokens: int = 0  # real response tokens (what a token-mean loss divides by)
    real_tokens: int = 0  # real prompt + response tokens
    computed_tokens: int = 0  # b x S: the positions the model runs
    # [b, S, L, k] int64 experts to replay per position and MoE layer; -1 where the row
    # has none (padding, a row's last token): engine/router_replay.py fills those
    routing: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Real rows (what a sequence-mean loss divides by)."""
        return self.num_real_rows


# ---------------------------------------------------------------------------------------
# planning: row lengths -> groups of row indices
# ---------------------------------------------------------------------------------------
def min_micro_batches(lengths: Sequence[int], spec: MicroBatching) -> int:
    """The fewest micro-batches ``spec`` allows for rows of these ``lengths`` (at least 1).

    Raises:
        ValueError: a single row is longer than the token budget.
    """
    if not spec.dynamic:
        return max(1, math.ceil(len(lengths) / spec.micro_batch_size))
    if not lengths:
        return 1
    _check_budget(lengths, spec)
    if spec.packed and not spec.similar_lengths:
        k = max(math.ceil(sum(lengths) / spec.max_tokens),
                math.ceil(len(lengths) / (spec.max_rows or len(lengths))))
        while _packed_groups(lengths, spec, k) is None:
            k += 1
        return k
    return len(_padded_groups(lengths, spec, spec.max_tokens))


def plan_micro_batches(lengths: Sequence[int], spec: MicroBatching,
                       count: int | None = None) -> list[list[int]]:
    """Group rows (given by their prompt + response ``lengths``) into micro-batches.

    Returns ``count`` groups of row indices (default: the fewest allowed); a group is
    empty when there are fewer rows than ``count``. Every row is in exactly one group.

    * fixed: consecutive runs of ``micro_batch_size`` rows (``count`` must be the
      fewest: the pipeline layout of a fixed plan is the row count);
    * token budget, packed: rows spread over ``count`` groups, longest first into the
      group with the fewest tokens that still has room (balanced real tokens);
    * token budget, padded (and packed with ``similar_lengths``): rows sorted by length
      and cut into ``count`` runs of similar length, balancing rows x longest row (the
      tokens each one computes).
    """
    fewest = min_micro_batches(lengths, spec)
    count = fewest if count is None else count
    if count < fewest:
        raise ValueError(f"{len(lengths)} rows need at least {fewest} micro-batches, not {count}")
    if not spec.dynamic:
        if count != fewest:
            raise ValueError("a fixed micro_batch_size plan has exactly "
                             f"ceil(rows / micro_batch_size) = {fewest} micro-batches")
        groups = [list(range(s, min(s + spec.micro_batch_size, len(lengths))))
                  for s in range(0, len(lengths), spec.micro_batch_size)]
        return groups or [[]]
    if spec.packed and not spec.similar_lengths:
        groups = _packed_groups(lengths, spec, count)
        if groups is None:  # greedy balancing missed: split the fewest-group plan instead
            groups = _split_to(_packed_groups(lengths, spec, fewest), count, lengths)
        return groups
    # Padded or similar lengths: the smallest cap on rows x longest row that still fits in
    # `count` runs.
    lo, hi = max(lengths), spec.max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_padded_groups(lengths, spec, mid)) <= count:
            hi = mid
        else:
            lo = mid + 1
    return _split_to(_padded_groups(lengths, spec, lo), count, lengths)


def _check_budget(lengths: Sequence[int], spec: MicroBatching) -> None:
    longest = max(lengths)
    if longest > spec.max_tokens:
        raise ValueError(f"a row of {longest} tokens (prompt + response) does not fit the "
                         f"micro-batch token budget max_packing_token_size={spec.max_tokens}")


def _packed_groups(lengths: Sequence[int], spec: MicroBatching, k: int) -> list[list[int]] | None:
    """Longest row first into the emptiest group that has room; None if a row finds none."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    tokens, groups = [0] * k, [[] for _ in range(k)]
    cap_rows = spec.max_rows or len(lengths)
    for i in order:
        fits = [g for g in range(k) if tokens[g] + lengths[i] <= spec.max_tokens
                and len(groups[g]) < cap_rows]
        if not fits:
            return None
        g = min(fits, key=lambda g: (tokens[g], g))
        tokens[g] += lengths[i]
        groups[g].append(i)
    return [sorted(g) for g in groups]


def _padded_groups(lengths: Sequence[int], spec: MicroBatching, cap: int) -> list[list[int]]:
    """Rows sorted longest first, cut greedily into runs with rows x longest <= cap."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    cap_rows = spec.max_rows or len(lengths)
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        # Sorted longest first: a run's first row is its longest.
        if g is not None and (len(g) + 1) * lengths[g[0]] <= cap and len(g) < cap_rows:
            g.append(i)
        else:
            groups.append([i])
    return groups


def _split_to(groups: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the costliest groups in two until there are ``count`` (empty ones last)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            groups.append([])
            continue
        k = max(splittable, key=lambda k: len(groups[k]) * max(lengths[i] for i in groups[k]))
        g = groups.pop(k)
        half = len(g) // 2
        groups[k:k] = [g[:half], g[half:]]
    return groups


# ---------------------------------------------------------------------------------------
# layout: one group of rows -> one MicroBatch
# ---------------------------------------------------------------------------------------
def _routing_buffer(routes, rows: list[int], b: int, S: int) -> torch.Tensor:
    """[b, S, MoE layers, top-k] expert ids of a micro-batch, -1 where no route is given."""
    tail = tuple(routes[rows[0]].shape[1:]) if rows else (0, 0)
    return torch.full((b, S) + tail, -1, dtype=torch.long)


def _place_routing(sequence: torch.Tensor, route: torch.Tensor, row: int, start: int,
                   n: int) -> None:
    """Write one row's routed experts at its tokens (``n`` tokens from ``start``)."""
    t = route.shape[0]
    if t > n - 1:
        raise ValueError(f"row {row}: routing of {t} tokens for {n - 1} fed ones (prompt "
                         "+ response - 1): the routed_experts column is out of step "
                         "with the tokens")
    sequence[start:start + t] = route.long()


def build_micro_batch(batch: RowBatch, rows: Sequence[int], *, packed: bool,
                      seq_len: int | None = None, resp_len: int | None = None,
                      num_sequences: int | None = None, pad_id: int = 0,
                      pad_multiple: int = 1, row_multiple: int = 1) -> MicroBatch:
    """Lay out ``rows`` of ``batch`` as one micro-batch.

    Padded: ``num_sequences`` sequences (default: one per row; missing ones are empty)
    of ``seq_len`` tokens (default: the group's longest row) and ``resp_len`` response
    slots (default: the group's longest response). Packed: one sequence holding every
    row. ``S`` is rounded up to a multiple of ``pad_multiple`` (sequence parallelism
    splits it over the TP ranks). Packed, ``row_multiple`` pads each row at its end to a
    multiple (context parallelism cuts every row into 2 x CP chunks). A group without rows
    gets one padding token.
    """
    rows = list(rows)
    plen = [len(batch.prompts[i]) for i in rows]
    rlen = [len(batch.responses[i]) for i in rows]
    real = sum(plen) + sum(rlen)
    # packed: each row's length in the sequence (its padding after its real tokens)
    padded = [-(-(p + r) // row_multiple) * row_multiple for p, r in zip(plen, rlen)]
    if packed:
        b = 1
        S = max(sum(padded), 1)
        R = max(sum(rlen), 1)
    else:
        b = num_sequences or max(len(rows), 1)
        S = seq_len or max([p + r for p, r in zip(plen, rlen)] or [1])
        R = resp_len or max(rlen or [1], default=1) or 1
    S = -(-S // pad_multiple) * pad_multiple
    tokens = torch.full((b, S), pad_id, dtype=torch.long)
    positions = torch.arange(S).unsqueeze(0).repeat(b, 1)
    response_ids = torch.full((b, R), pad_id, dtype=torch.long)
    response_index = torch.zeros((b, R), dtype=torch.long)
    mask = torch.zeros((b, R))
    routes = batch.extras.get(ROUTING)
    extras = {k: torch.zeros((b, R)) for k in batch.extras if k != ROUTING}
    routing = None if routes is None else _routing_buffer(routes, rows, b, S)
    spans: list[tuple[int, int, int]] = []
    offset, r_offset = 0, 0  # packed: where the next row starts in S and in R
    for k, i in enumerate(rows):
        p, r = batch.prompts[i], batch.responses[i]
        j = 0 if packed else k
        start, r_start = (offset, r_offset) if packed else (0, 0)
        n = len(p) + len(r)
        tokens[j, start:start + len(p)] = p
        tokens[j, start + len(p):start + n] = r
        if packed:
            positions[0, start:start + padded[k]] = torch.arange(padded[k])
        response_ids[j, r_start:r_start + len(r)] = r
        # the output at position t predicts token t+1
        response_index[j, r_start:r_start + len(r)] = torch.arange(start + len(p) - 1,
                                                                   start + n - 1)
        mask[j, r_start:r_start + len(r)] = 1.0
        if routing is not None:
            _place_routing(routing[j], routes[i], i, start, n)
        for name, values in batch.extras.items():
            if name == ROUTING:
                continue
            v = values[i].float()
            extras[name][j, r_start:r_start + len(r)] = v if v.numel() == len(r) else \
                v.expand(len(r))
        spans.append((j, r_start, len(r)))
        if packed:
            offset += padded[k]
            r_offset += len(r)
    if packed:
        # Padding after the last row (pad_multiple) restarts its own positions.
        positions[0, offset:] = torch.arange(S - offset)
    if LOSS_MASK in extras:  # multi-turn: tool responses and template glue are not the model's
        mask = mask * extras.pop(LOSS_MASK)
    segments = (padded + ([S - offset] if S > offset else []) if packed else None)
    return MicroBatch(tokens, positions, response_index, response_ids, mask, extras, len(rows),
                      rows, spans, segments, list(zip(plen, rlen)), num_tokens=int(mask.sum()),
                      real_tokens=real,
                      computed_tokens=b * S, routing=routing)


def unit_lengths(batch: RowBatch, rows_per_unit: int = 1) -> list[int]:
    """The tokens of each unit the planner places whole: a row, or ``rows_per_unit``
    consecutive rows (DPO's pairs: a chosen and a rejected row side by side)."""
    lengths = batch.lengths()
    if len(lengths) % rows_per_unit:
        raise ValueError(f"{len(lengths)} rows do not split into units of {rows_per_unit}")
    return [sum(lengths[i:i + rows_per_unit]) for i in range(0, len(lengths), rows_per_unit)]


def make_micro_batches(batch: RowBatch, micro_batching: "int | MicroBatching",
                       count: int | None = None, pad_id: int = 0,
                       pad_multiple: int = 1, row_multiple: int = 1,
                       rows_per_unit: int = 1) -> list[MicroBatch]:
    """The micro-batches of ``batch`` (``count`` of them: see :func:`plan_micro_batches`).

    A plain int ``micro_batching`` is today's layout: ``micro_batch_size`` rows per
    micro-batch (missing rows are empty, mask 0), every micro-batch as long as the
    longest row of the whole batch (the pipeline schedule then sees one shape).
    ``rows_per_unit`` > 1: consecutive rows stay in one micro-batch (a DPO pair), the plan
    counts units (``micro_batch_size`` units of ``rows_per_unit`` rows each).
    """
    spec = MicroBatching.of(micro_batching)
    units = plan_micro_batches(unit_lengths(batch, rows_per_unit), spec, count)
    groups = [[u * rows_per_unit + k for u in g for k in range(rows_per_unit)] for g in units]
    if not spec.dynamic and not spec.packed:
        seq_len = max(batch.lengths(), default=1)
        resp_len = max((len(r) for r in batch.responses), default=1) or 1
        return [build_micro_batch(batch, g, packed=False, seq_len=seq_len, resp_len=resp_len,
                                  num_sequences=spec.micro_batch_size * rows_per_unit,
                                  pad_id=pad_id, pad_multiple=pad_multiple) for g in groups]
    return [build_micro_batch(batch, g, packed=spec.packed, pad_id=pad_id,
                              pad_multiple=pad_multiple, row_multiple=row_multiple)
            for g in groups]
