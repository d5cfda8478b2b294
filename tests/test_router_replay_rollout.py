"""Routing replay R3: vLLM's routed experts recorded on its in-process CPU runner, replayed
in megatron-core (one launch, one engine, a tiny Qwen3-MoE with 16 experts, top-2).

* every completion carries ``[prompt + response - 1, MoE layers, k]`` routes, for
  ``generate`` with several samples per prompt and for the step-wise engine (a stopped
  request included);
* the rows are the requests' own: in fp32, megatron's free routing of the same tokens
  agrees with vLLM's on nearly every (token, layer) (a row given to the wrong request
  would differ on most);
* replayed in megatron's forward (the old-log-prob and reference passes), the dispatched
  routing equals vLLM's in every MoE layer (0 differences); replaying other routes (each
  expert id shifted by one) dispatches exactly those, which the free routing never chose;
* a partial rollout's continued row keeps its first segment's routes for the tokens that
  segment fed and takes the continuation's for the rest: its routing stays aligned with its
  tokens (length and values equal the uninterrupted response's under greedy decoding).
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

EXPERTS, TOPK = 16, 2


def _free_and_replayed(model, arch, prompts, responses, routes):
    """(per-layer differences of megatron's free routing from ``routes``, the replayed
    pass's per-layer differences, the update's routing/diff_fraction)."""
    from mindspeed_rl.algorithms.routing import differing_routes
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.engine.actor import forward_logprobs
    from mindspeed_rl.engine.micro_batches import ROUTING, RowBatch
    from mindspeed_rl.engine.router_replay import RECORD, REPLAY, RouterReplayer

    spec = MicroBatching(micro_batch_size=2)
    free = RouterReplayer(model, RECORD)
    logp, _ = forward_logprobs(model, RowBatch(prompts, responses, {}), spec, arch.vocab_size,
                               routing=free)
    free.finish()
    free_diff = sum(differing_routes(f, r) for f, r in zip(free.recorded(len(prompts)), routes))
    replay = RouterReplayer(model, REPLAY)
    forward_logprobs(model, RowBatch(prompts, responses, {ROUTING: routes}), spec,
                     arch.vocab_size, routing=replay)
    replay.finish()
    tokens = sum(len(r) for r in routes)
    return free_diff.tolist(), replay.differing.tolist(), replay.compared, tokens, logp


def _worker(hf_dir: str):
    import torch.distributed as dist

    from mindspeed_rl.algorithms.routing import carry_routing
    from mindspeed_rl.config.schema import SamplingConfig
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.rollout import RolloutEngine

    setup_platform()
    arch = describe_hf_dir(hf_dir)
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), 1, 1), seed=1234)
    out = {}
    try:
        engine = RolloutEngine(hf_dir, max_model_len=96, max_num_seqs=8,
                               gpu_memory_utilization=0.02, enable_prefix_caching=False,
                               record_routing=True)
        prompts = [[5, 6, 7, 8, 9], [9, 10, 11], [40, 41, 42, 43, 44, 45, 46], [20, 21]]
        sampled = SamplingConfig(temperature=1.0, max_tokens=12)
        groups = engine.generate(prompts, 2, sampled, seeds=[1, 2, 3, 4]).completions
        rows = [(p, c) for p, g in zip(prompts, groups) for c in g]
        stepwise = engine.generate_stepwise(prompts, sampled, seeds=[5, 6, 7, 8],
                                            stop=lambda finished: True, check_every=4)
        rows += [(p, g[0]) for p, g in zip(prompts, stepwise.completions)]
        out["shapes"] = [(tuple(c.routed_experts.shape), len(p) + len(c.token_ids) - 1,
                          str(c.routed_experts.dtype)) for p, c in rows]
        out["stopped"] = [g[0].finish_reason for g in stepwise.completions]
        # partial rollout under greedy: two segments against one uninterrupted response
        greedy = SamplingConfig(temperature=0.0, max_tokens=12)
        whole = engine.generate(prompts, 1, greedy).completions
        first = engine.generate(prompts, 1, greedy, max_tokens=[5] * 4).completions
        second = engine.generate([p + g[0].token_ids for p, g in zip(prompts, first)], 1,
                                 greedy, max_tokens=[7] * 4).completions
        carried = []
        for w, a, b in zip(whole, first, second):
            routes = carry_routing(a[0].routed_experts, b[0].routed_experts)
            carried.append((a[0].token_ids + b[0].token_ids == w[0].token_ids,
                            tuple(routes.shape) == tuple(w[0].routed_experts.shape),
                            bool(torch.equal(routes, w[0].routed_experts))))
        out["carried"] = carried
        model = build_gpt_model(arch, build_transformer_config(
            arch, calculate_per_token_loss=True, moe_enable_routing_replay=True))
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        ps = [torch.tensor(p) for p, _ in rows]
        rs = [torch.tensor(c.token_ids) for _, c in rows]
        free, replayed, compared, tokens, _ = _free_and_replayed(
            model, arch, ps, rs, [c.routed_experts for _, c in rows])
        out["fp32"] = dict(free=free, replayed=replayed, compared=compared, tokens=tokens)
        shifted = [((c.routed_experts.long() + 1) % EXPERTS).to(torch.uint8) for _, c in rows]
        free, replayed, compared, tokens, _ = _free_and_replayed(model, arch, ps, rs, shifted)
        out["shifted"] = dict(free=free, replayed=replayed, compared=compared, tokens=tokens)
        engine.shutdown()
        return out
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen3_moe", tmp_path_factory.mktemp("r3") / "moe", seed=5,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK)
    return run_on_ranks(_worker, 1, str(hf_dir), timeout=900)[0]


def test_every_completion_carries_its_routes(results):
    for shape, fed, dtype in results["shapes"]:
        assert shape == (fed, 2, TOPK)
        assert dtype == "torch.uint8"
    assert "abort" in results["stopped"]  # a stopped request's routes are kept too


def test_routes_belong_to_their_requests(results):
    r = results["fp32"]
    # fp32 on both sides: the free routing agrees with vLLM's nearly everywhere
    assert sum(r["free"]) <= 0.02 * r["tokens"] * len(r["free"])


def test_replayed_routing_equals_the_rollout_in_every_layer(results):
    r = results["fp32"]
    assert r["compared"] == r["tokens"]
    assert r["replayed"] == [0, 0]
    shifted = results["shifted"]
    assert shifted["free"] == [shifted["tokens"]] * 2  # routes the routers would not choose
    assert shifted["replayed"] == [0, 0]  # are the ones dispatched


def test_continued_row_keeps_routes_aligned_with_its_tokens(results):
    for same_tokens, same_shape, same_routes in results["carried"]:
        assert same_tokens and same_shape and same_routes
