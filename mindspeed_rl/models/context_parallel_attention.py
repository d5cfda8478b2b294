"""Causal attention of packed rows split over a context-parallel (CP) group, on CPU.

Each CP rank holds, of every packed row, the two zig-zag chunks of
`mindspeed_rl.parallel.context_parallel` (chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP``).

* :func:`ring_attention` (``context_parallel_algo: megatron_cp_algo``, megatron's
  ``cp_comm_type="p2p"``): K/V pass around the ring in ``CP - 1`` steps while each rank
  attends its queries to the block it holds: its own chunks causally (their concatenation
  is in order, so one causal call covers both), an earlier rank's first chunk fully from
  every query, a later rank's both chunks fully from the second chunk's queries. Blocks are
  torch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
  returns each row's log-sum-exp), merged by log-sum-exp. The backward is explicit: autograd
  through the merge is wrong (the LSE is not differentiable there); each block's flash
  backward is fed the *merged* output and LSE, dQ is summed locally, and dK/dV travel the
  ring with K/V back to their owner.
* :func:`ulysses_attention` (``ulysses_cp_algo``, ``cp_comm_type="a2a"``): megatron's
  all-to-all (``tensor_parallel.mappings.all_to_all``, with its backward) swaps sequence for
  head sharding: every rank gets the whole packed sequence for ``heads / CP`` of the heads,
  runs ordinary packed attention on it, and the reverse all-to-all brings the sequence
  split back.

No ``[T, T]`` tensor: memory stays linear in the row length.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from mindspeed_rl.parallel.context_parallel import cp_token_index


# ---- one block of the CPU flash kernel, on [L, heads, d] ----------------------------------

def _block_forward(q, k, v, causal: bool, scale: float):
    """[Lq, n, d], [Lk, n, d] x2 -> out [Lq, n, d] (fp32), lse [n, Lq] (fp32)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), 0.0, causal, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].float()


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """The flash backward of one block, given the merged ``out`` and ``lse`` of its queries."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(0, 1).unsqueeze(0).to(q.dtype) for t in (dout, q, k, v, out)),
        lse.unsqueeze(0), 0.0, causal, scale=scale)
    return tuple(t[0].transpose(0, 1).float() for t in (dq, dk, dv))


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold one block's (output, LSE) of the queries ``rows`` into the running ones."""
    old_lse = lse[:, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[rows] = (out[rows] * torch.exp(old_lse - new_lse).t().unsqueeze(-1)
                 + block_out * torch.exp(block_lse - new_lse).t().unsqueeze(-1))
    lse[:, rows] = new_lse


def _ring_exchange(tensor: torch.Tensor, group) -> tuple[list, torch.Tensor]:
    """Send ``tensor`` to the next rank of the ring, receive the previous rank's."""
    ranks = dist.get_process_group_ranks(group)
    rank, size = group.rank(), group.size()
    received = torch.empty_like(tensor)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, ranks[(rank + 1) % size], group),
        dist.P2POp(dist.irecv, received, ranks[(rank - 1) % size], group)])
    return requests, received


def _row_blocks(step: int, source_is_earlier: bool, offset: int, half: int):
    """(query slice, key/value slice, causal) of one row at one ring step. Rank r holds
    chunks r and 2CP-1-r of the row (``half`` tokens each, from ``offset``)."""
    whole = slice(offset, offset + 2 * half)
    if step == 0:  # its own chunks: in order, so one causal call
        return whole, whole, True
    if source_is_earlier:  # chunks j < r and 2CP-1-j > 2CP-1-r: only chunk j is visible
        return whole, slice(offset, offset + half), False
    # chunks j > r and 2CP-1-j < 2CP-1-r: both visible, to the second chunk's queries only
    return slice(offset + half, offset + 2 * half), whole, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows, scale, group):
        rank, size = group.rank(), group.size()
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.full((q.size(1), q.size(0)), float("-inf"))
        kv = torch.stack([k, v])
        for step in range(size):
            pending = _ring_exchange(kv, group) if step + 1 < size else None
            earlier = (rank - step) % size < rank
            for offset, half in rows:
                qs, ks, causal = _row_blocks(step, earlier, offset, half)
                block_out, block_lse = _block_forward(q[qs], kv[0, ks], kv[1, ks], causal, scale)
                _merge(out, lse, block_out, block_lse, qs)
            if pending is not None:
                for request in pending[0]:
                    request.wait()
                kv = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rows, ctx.scale, ctx.group = rows, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rows, scale, group = ctx.rows, ctx.scale, ctx.group
        rank, size = group.rank(), group.size()
        dq = torch.zeros(q.shape, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32)  # travels with kv to its owner
        for step in range(size):
            earlier = (rank - step) % size < rank
            for offset, half in rows:
                qs, ks, causal = _row_blocks(step, earlier, offset, half)
                dq_b, dk_b, dv_b = _block_backward(dout[qs], q[qs], kv[0, ks], kv[1, ks],
                                                   out[qs], lse[:, qs], causal, scale)
                dq[qs] += dq_b
                dkv[0, ks] += dk_b
                dkv[1, ks] += dv_b
            if step + 1 < size:
                requests, both = _ring_exchange(torch.cat([kv, dkv.to(kv.dtype)]), group)
                for request in requests:
                    request.wait()
                kv, dkv = both[:2], both[2:].float()
            else:  # the last hop: dK/dV of the block held now go to their owner
                requests, dkv = _ring_exchange(dkv, group)
                for request in requests:
                    request.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def local_rows(segments: list[int], cp_size: int) -> list[tuple[int, int]]:
    """(offset, chunk length) of each packed row in a CP rank's local tokens: a row of
    ``n`` tokens (a multiple of ``2 CP``) holds ``2 n / (2 CP)`` of them locally."""
    rows, offset = [], 0
    for n in segments:
        half = n // (2 * cp_size)
        if half:
            rows.append((offset, half))
        offset += 2 * half
    return rows


def ring_attention(q, k, v, segments: list[int], scale: float, group) -> torch.Tensor:
    """Causal attention of this rank's zig-zag chunks ``[t, n, d]`` (K/V heads already as
    many as the query heads) of packed rows of global lengths ``segments``."""
    if q.device.type != "cpu":
        raise NotImplementedError("ring attention here runs on CPU; on CUDA Transformer "
                                  "Engine's attention does context parallelism")
    return _RingAttention.apply(q, k, v, local_rows(segments, group.size()), scale, group)


def ulysses_attention(q, k, v, segments: list[int], group,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> torch.Tensor:
    """All-to-all to ``[T, heads / CP, d]`` in packed order, ``attend`` (packed causal
    attention of the whole rows), all-to-all back to this rank's ``[t, heads, d_v]``."""
    from megatron.core.tensor_parallel.mappings import all_to_all

    size = group.size()
    # packed position of each token as the all-to-all delivers them (rank 0's, rank 1's...)
    order = torch.cat([cp_token_index(segments, size, r) for r in range(size)])
    restore = torch.empty_like(order)
    restore[order] = torch.arange(len(order))

    def to_heads(x):  # [t, n, d] -> [T, n / CP, d] in packed order
        t, n, d = x.shape
        x = x.reshape(t, size, n // size, d).transpose(0, 1).contiguous()  # [CP, t, n/CP, d]
        x = all_to_all(group, x.reshape(size * t, n // size, d))  # rank-major tokens
        return x[restore]

    out = attend(to_heads(q), to_heads(k), to_heads(v))  # [T, n / CP, dv]
    T, h, dv = out.shape
    out = out[order].reshape(size, T // size, h, dv)  # [CP (rank's tokens), t, n/CP, dv]
    out = all_to_all(group, out.reshape(T, h, dv)).reshape(size, T // size, h, dv)
    return out.transpose(0, 1).reshape(T // size, size * h, dv)  # [t, n, dv]
