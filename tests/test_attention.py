"""The core attention of our models (`mindspeed_rl.models.attention`) against megatron's.

One single-rank launch (megatron's parallel state stays out of the pytest process) checks,
fp32, outputs and input gradients within 1e-5 of megatron-core's local DotProductAttention:
causal MHA and 4:1 grouped-query attention ([s, b, n, d]), packed rows (THD, ragged lengths,
several row groups) against one DotProductAttention call per row, query/key and value head
sizes that differ (multi-latent attention) against the attention formula in float64,
16-bit inputs with the softmax in fp32; that no saved tensor of a packed forward is
``[T, T]``-sized; which class each platform gets; and, on a tiny qwen2, that packed
log-probs equal padded ones both through THD (ours) and side by side (megatron's).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.testing.multiprocess import run_on_ranks

TOL = 1e-5
ROWS = [5, 7, 1, 12, 11, 3, 12, 9]  # packed row lengths: several groups, equal and ragged


def _config(heads=4, groups=4, kv_channels=8, **kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * kv_channels,
                             num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=kv_channels, attention_dropout=0.0,
                             use_cpu_initialization=True, **kw)


def _run(module, q, k, v, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, None, **kw)
    g = torch.Generator().manual_seed(3)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _diff(a, b) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def _packed_paths(hf_dir: str) -> dict:
    """A tiny qwen2 with our attention (packed rows as THD) and with megatron's local one
    (packed rows side by side inside attention): packed log-probs equal the padded ones."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.engine.actor import forward_logprobs
    from mindspeed_rl.engine.micro_batches import RowBatch
    from mindspeed_rl.engine.packing import packing_backend
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader

    arch = describe_hf_dir(hf_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=g) for n in (3, 9, 4, 6, 2)]
    responses = [torch.randint(3, 300, (int(n),), generator=g) for n in (7, 1, 12, 5, 10)]
    batch = RowBatch(prompts, responses, {})
    out = {}
    for name, attention in (("ours", None), ("megatron", DotProductAttention)):
        model = build_gpt_model(arch, build_transformer_config(arch), core_attention=attention)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        kinds = {type(layer.self_attention.core_attention).__name__
                 for layer in model.decoder.layers}
        padded, _ = forward_logprobs(model, batch, MicroBatching(micro_batch_size=5),
                                     arch.vocab_size)
        packed, _ = forward_logprobs(model, batch, MicroBatching(micro_batch_size=5,
                                                                 packed=True), arch.vocab_size)
        out[name] = {"kinds": kinds, "backend": packing_backend(model), "padded": padded,
                     "packed_diff": max(float((a - b).abs().max())
                                        for a, b in zip(packed, padded))}
    out["ours_vs_megatron"] = max(float((a - b).abs().max()) for a, b in
                                  zip(out["ours"]["padded"], out["megatron"]["padded"]))
    return out


def _worker(hf_dir: str):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_rl.models.attention import SDPAttention, core_attention_class
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(1, 1, 1), seed=1)
    g = torch.Generator().manual_seed(0)
    out = {}

    def pair(config, **kw):
        args = (config, 1, AttnMaskType.causal, "self")
        return SDPAttention(*args, **kw), DotProductAttention(*args)

    # ---- [s, b, n, d]: MHA and GQA 4:1 ---------------------------------------------------
    for name, heads, groups in [("mha", 4, 4), ("gqa", 8, 2)]:
        ours, megatron = pair(_config(heads, groups))
        q = torch.randn(24, 3, heads, 8, generator=g)
        k, v = (torch.randn(24, 3, groups, 8, generator=g) for _ in range(2))
        a, b = _run(ours, q, k, v), _run(megatron, q, k, v)
        out[name] = (_diff(a, b), tuple(a[0].shape) == tuple(b[0].shape))

    # ---- packed rows (THD) against one megatron call per row ------------------------------
    ours, megatron = pair(_config(8, 2))
    T = sum(ROWS)
    q = torch.randn(T, 8, 8, generator=g)
    k, v = (torch.randn(T, 2, 8, generator=g) for _ in range(2))
    cu = torch.tensor([0] + ROWS).cumsum(0).to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(ROWS), max_seqlen_kv=max(ROWS))
    a = _run(ours, q, k, v, packed_seq_params=params)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rows = [megatron(*(t[s:e].unsqueeze(1) for t in (qs, ks, vs)), None)[:, 0]
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = torch.cat(rows)
    gen = torch.Generator().manual_seed(3)
    (ref * torch.randn(ref.shape, generator=gen)).sum().backward()
    out["thd"] = (_diff(a, (ref.detach(), qs.grad, ks.grad, vs.grad)), tuple(a[0].shape))

    # No saved tensor of the packed forward holds T x T elements (megatron's local one does).
    def largest_saved(module, **kw):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t,
                                                      lambda t: t):
            long_q = torch.randn(512, 8, 8, requires_grad=True)
            long_kv = torch.randn(512, 2, 8, requires_grad=True)
            module(long_q, long_kv, long_kv, None, **kw).sum()
        return max(sizes)

    cu_long = torch.tensor([0, 300, 512], dtype=torch.int32)
    long_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_long,
                                  cu_seqlens_kv=cu_long, max_seqlen_q=300, max_seqlen_kv=300)
    out["saved"] = largest_saved(ours, packed_seq_params=long_params)
    out["saved_megatron"] = max(
        largest_saved(lambda q_, k_, v_, m: megatron(q_.unsqueeze(1), k_.unsqueeze(1),
                                                     v_.unsqueeze(1), m)), 0)

    # ---- different query/key and value head sizes (MLA) against the formula -------------
    ours = SDPAttention(_config(4, 4, kv_channels=12), 1, AttnMaskType.causal, "self",
                        k_channels=12, v_channels=6)
    q, k = (torch.randn(10, 2, 4, 12, generator=g) for _ in range(2))
    v = torch.randn(10, 2, 4, 6, generator=g)
    got = ours(q, k, v, None)
    scores = torch.einsum("sbnd,tbnd->bnst", q.double(), k.double()) / 12 ** 0.5
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v.double()).reshape(10, 2, 24)
    out["mla"] = (float((got.double() - want).abs().max()), tuple(got.shape))

    # ---- bf16 inputs, softmax in fp32 ----------------------------------------------------
    ours, _ = pair(_config(4, 4, attention_softmax_in_fp32=True))
    q, k, v = (torch.randn(64, 1, 4, 8, generator=g) for _ in range(3))
    low = ours(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    out["bf16"] = (low.dtype, float((low.double() - ours(q, k, v, None).double()).abs().max()))

    out["classes"] = {d: core_attention_class(d).__name__ for d in ("cpu", "cuda", "npu")}
    out["npu_no_flash"] = core_attention_class("npu", use_flash_attn=False).__name__
    out["model"] = _packed_paths(hf_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    hf_dir = make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("attention") / "qwen2", seed=3)
    return run_on_ranks(_worker, 1, str(hf_dir), timeout=300)[0]


def test_causal_attention_equals_megatron_local(results):
    for name in ("mha", "gqa"):
        diff, same_shape = results[name]
        assert same_shape and diff < TOL, (name, diff)


def test_packed_rows_equal_one_call_per_row(results):
    diff, shape = results["thd"]
    assert shape == (sum(ROWS), 8 * 8)
    assert diff < TOL


def test_packed_rows_build_no_square_tensor(results):
    # 512 packed tokens: megatron saves [heads, 512, 512] scores; ours only [T, heads, d]-sized
    assert results["saved_megatron"] >= 512 * 512
    assert results["saved"] < 512 * 64


def test_value_head_size_may_differ(results):
    diff, shape = results["mla"]
    assert shape == (10, 2, 4 * 6) and diff < TOL


def test_bf16_with_fp32_softmax(results):
    dtype, diff = results["bf16"]
    assert dtype == torch.bfloat16 and diff < 2e-2


def test_platform_choice(results):
    # no Transformer Engine here: CUDA falls back to SDPA too
    assert results["classes"] == {"cpu": "SDPAttention", "cuda": "SDPAttention",
                                  "npu": "DotProductAttention"}
    assert results["npu_no_flash"] == "SDPAttention"


def test_row_groups():
    from mindspeed_rl.models.attention import _row_groups

    assert _row_groups([5, 7, 1, 12, 11, 3, 12, 9]) == [[3, 6, 4, 7], [1], [0], [5], [2]]
    assert _row_groups([4, 0, 4]) == [[0, 2]]


def test_models_use_it_and_both_packing_paths_are_exact(results):
    """Built models carry SDPAttention in every layer and pack rows as THD; megatron's local
    attention (NPU's class) packs them side by side; both give the padded log-probs, and
    the two attentions give the same log-probs."""
    r = results["model"]
    assert r["ours"]["kinds"] == {"SDPAttention"} and r["ours"]["backend"] == "thd"
    assert r["megatron"]["kinds"] == {"DotProductAttention"}
    assert r["megatron"]["backend"] == "rows"
    assert r["ours"]["packed_diff"] < TOL and r["megatron"]["packed_diff"] < TOL
    assert r["ours_vs_megatron"] < TOL
