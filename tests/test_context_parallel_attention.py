"""Ring and Ulysses attention over a context-parallel group equal one rank's attention.

One 4-rank gloo launch (fp32) runs CP 2 (two CP groups) and CP 4, each with ring
(``cp_comm_type="p2p"``) and Ulysses (``"a2a"``), 8 query heads over 4 KV heads, on packed
rows of ragged lengths (multiples of 2 x CP, as the engine pads them): every rank holds its
zig-zag chunks; the outputs put back in token order and each rank's gradients of its own
query/key/value tokens equal torch SDPA's on the whole rows within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

TOL = 1e-5
HEADS, GROUPS, DIM = 8, 4, 8


def _rows(cp: int) -> list[int]:
    return [s * 2 * cp for s in (3, 1, 5, 2)]  # several rows, ragged


def _reference(q, k, v, segments):
    """Per-row causal SDPA on the whole rows ([T, n, d]); grads of sum(out * w)."""
    import torch.nn.functional as F

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs, start = [], 0
    for n in segments:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                   enable_gqa=True).transpose(0, 1))
        start += n
    return torch.cat(outs), q, k, v


def _worker():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_rl.models.attention import SDPAttention
    from mindspeed_rl.parallel.context_parallel import cp_token_index, restore_token_order
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    out = {}
    for cp in (2, 4):
        initialize_megatron_parallel(ParallelLayout(dist.get_world_size(),
                                                    context_parallel_size=cp), seed=1)
        try:
            rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
            segments = _rows(cp)
            T = sum(segments)
            g = torch.Generator().manual_seed(11)
            q = torch.randn(T, HEADS, DIM, generator=g)
            k, v = (torch.randn(T, GROUPS, DIM, generator=g) for _ in range(2))
            w = torch.randn(T, HEADS * DIM, generator=g)
            ref, rq, rk, rv = _reference(q, k, v, segments)
            (ref.reshape(T, -1) * w).sum().backward()
            idx = cp_token_index(segments, cp, rank)
            cu = torch.tensor([0] + segments).cumsum(0).to(torch.int32)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(segments), max_seqlen_kv=max(segments))
            for comm in ("p2p", "a2a"):
                config = TransformerConfig(
                    num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                    num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                    context_parallel_size=cp, cp_comm_type=comm, use_cpu_initialization=True)
                module = SDPAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm)
                lq, lk, lv = (t[idx].clone().requires_grad_() for t in (q, k, v))
                local = module(lq, lk, lv, None, packed_seq_params=params)  # [t, n*d]
                (local * w[idx]).sum().backward()
                parts = [torch.empty_like(local) for _ in range(cp)]
                dist.all_gather(parts, local.detach().contiguous(), group=group)
                whole = restore_token_order(parts, segments)
                out[(cp, comm)] = {
                    "shape": tuple(local.shape) == (T // cp, HEADS * DIM),
                    "out": float((whole - ref.reshape(T, -1)).abs().max()),
                    "dq": float((lq.grad - rq.grad[idx]).abs().max()),
                    "dk": float((lk.grad - rk.grad[idx]).abs().max()),
                    "dv": float((lv.grad - rv.grad[idx]).abs().max()),
                    "grad_scale": float(rk.grad.abs().max()),
                }
        finally:
            destroy_megatron_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_worker, 4, timeout=600)


@pytest.mark.parametrize("comm", ["p2p", "a2a"], ids=["ring", "ulysses"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_whole_rows(results, cp, comm):
    for rank, r in enumerate(results):
        diffs = r[(cp, comm)]
        assert diffs["shape"] and diffs["grad_scale"] > 1e-2, (rank, diffs)
        assert max(diffs[k] for k in ("out", "dq", "dk", "dv")) < TOL, (rank, diffs)
