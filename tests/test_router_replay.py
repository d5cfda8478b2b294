"""Routing replay R2 in the training engine (megatron-core's RouterReplay, one gloo rank).

A tiny Qwen3-MoE (16 experts, top-2): the old-log-prob pass records its routing; the update
replays it in every micro-step. After an optimizer step with a large learning rate the
routers choose other experts on their own (checked: a free forward differs from the
recorded routing), yet the update's dispatched routing equals the recorded one in every
layer (0 differences), in the padded and in the packed layout, and the router still gets
gradients.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

ROWS, EXPERTS, TOPK = 4, 16, 2


def _worker(hf_dir: str):
    import torch.distributed as dist

    from mindspeed_rl.algorithms.routing import differing_routes
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.config.schema import ActorConfig, RLConfig
    from mindspeed_rl.engine.actor import MegatronActor, forward_logprobs
    from mindspeed_rl.engine.micro_batches import ROUTING, RowBatch
    from mindspeed_rl.engine.router_replay import (RECORD, RouterReplayer, RouterReplayError,
                                                   model_routers)
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir, load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    arch = describe_hf_dir(hf_dir)
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), 1, 1), seed=1234)
    try:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 300, (5 + k,), generator=g) for k in range(ROWS)]
        responses = [torch.randint(3, 300, (4 + 2 * k,), generator=g) for k in range(ROWS)]
        model = build_gpt_model(arch, build_transformer_config(
            arch, calculate_per_token_loss=True, moe_enable_routing_replay=True))
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        padded, packed = MicroBatching(micro_batch_size=2), \
            MicroBatching(micro_batch_size=2, max_tokens=64, packed=True)

        def record():
            rec = RouterReplayer(model, RECORD)
            try:
                logp, _ = forward_logprobs(model, RowBatch(prompts, responses, {}), padded,
                                           arch.vocab_size, routing=rec)
            finally:
                rec.finish()
            return logp, rec.recorded(ROWS)

        out = {}
        logp_old, routes = record()
        out["shapes"] = [tuple(r.shape) for r in routes]
        out["dtype"] = str(routes[0].dtype)
        out["lengths"] = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
        actor = MegatronActor(model, ActorConfig(lr=0.3, weight_decay=0.0, clip_grad=0.0),
                              total_steps=4, use_distributed_optimizer=False, bf16=False)
        adv = [torch.randn(len(r), generator=g) for r in responses]
        rows = RowBatch(prompts, responses, {"advantages": adv, "logprobs_old": logp_old,
                                             ROUTING: routes})
        rl = RLConfig(clip_ratio=0.2, entropy_coeff=0.0)
        steps = []
        for spec in (padded, padded, packed):
            stats = actor.update(rows, spec, rl, kl_coef=0.0, vocab_size=arch.vocab_size,
                                 replay_routing=True)  # the job's feature (router_replay R2)
            router_grad = sum(float(r.weight.main_grad.abs().sum()) for r in model_routers(model))
            steps.append((stats["routing/diff_fraction"], stats["update_ok"], router_grad))
        out["steps"] = steps
        # without replay the routers now choose otherwise: the 0 above is the replay's
        _, free = record()
        per_layer = sum(differing_routes(f, r) for f, r in zip(free, routes))
        out["free_differences"] = per_layer.tolist()
        out["backward_lists"] = [len(r.router_replay.replay_backward_list)
                                 for r in model_routers(model)]
        model.config.moe_router_fusion = True
        try:
            RouterReplayer(model, RECORD)
        except RouterReplayError as e:
            out["fusion"] = str(e)
        return out
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = make_tiny_hf_dir("qwen3_moe", tmp_path_factory.mktemp("rr") / "moe", seed=5,
                              num_experts=EXPERTS, num_experts_per_tok=TOPK)
    return run_on_ranks(_worker, 1, str(hf_dir), timeout=600)[0]


def test_recorded_routing_is_one_row_per_fed_token(results):
    assert results["shapes"] == [(t, 2, TOPK) for t in results["lengths"]]
    assert results["dtype"] == "torch.uint8"


def test_update_replays_the_old_pass_routing_after_optimizer_steps(results):
    for diff, ok, router_grad in results["steps"]:
        assert ok == 1.0
        assert diff == 0.0
        assert router_grad > 0  # the router weights are recomputed: they keep their gradient


def test_free_routing_differs_after_the_steps(results):
    assert all(d > 0 for d in results["free_differences"])


def test_replay_state_is_cleared_every_step(results):
    assert results["backward_lists"] == [0, 0]


def test_fused_router_is_refused(results):
    assert "moe_router_fusion" in results["fusion"]
