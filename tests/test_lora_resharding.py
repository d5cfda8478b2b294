"""LoRA and the allgather-swap: vLLM receives W + (alpha/r) B A, training keeps W unmerged.

The actor carries adapters with a non-zero B (as after some training); vLLM starts from
dummy weights, so every token it samples comes from what the stream pushed. The rollout
log-probs must equal megatron's log-probs of the adapted model (<= 1e-3 in fp32, the
mismatch metric's bound), which they cannot if vLLM got the bare backbone; afterwards the
backbone shards are bitwise what they were.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models import tiny as tiny_hf
from mindspeed_rl.testing import run_on_ranks
from tests.test_resharding import MAX_TOKENS, PROMPTS, _actor, _engine_and_resharder

pytestmark = pytest.mark.slow


def lora_parity_body(hf_dir, layout_kwargs, infer_tp):
    from mindspeed_rl.models.lora import adapters_disabled, add_lora_adapters
    from mindspeed_rl.resharding.rollout_parity import rollout_parity

    platform, model, arch, chunks, optimizer = _actor(hf_dir, layout_kwargs)
    add_lora_adapters(model, ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), 4, 8.0,
                      seed=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    backbone = {k: p.detach().clone() for k, p in model.named_parameters() if ".lora_" not in k}
    engine, resharder = _engine_and_resharder(hf_dir, platform, model, arch, chunks, optimizer,
                                              infer_tp)
    responses, diff = rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS)
    # The same rollout scored by the backbone alone: the adapters matter for these tokens.
    with adapters_disabled(model):
        _, diff_backbone = rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS)
    unmerged = all(torch.equal(p, backbone[k]) for k, p in model.named_parameters()
                   if ".lora_" not in k)
    return {"responses": responses, "diff": diff, "diff_backbone": diff_backbone,
            "unmerged": unmerged}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return str(tiny_hf.make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("lora_rs") / "qwen2"))


@pytest.mark.parametrize("layout, infer_tp", [
    ({"tensor_model_parallel_size": 2}, 1),
    ({"pipeline_model_parallel_size": 2}, 2),
])
def test_vllm_runs_the_merged_weights(hf_dir, layout, infer_tp):
    for r in run_on_ranks(lora_parity_body, 2, hf_dir, layout, infer_tp):
        assert r["diff"] <= 1e-3, r["diff"]
        assert r["diff_backbone"] > 0.05, r["diff_backbone"]   # the adapters matter
        assert r["unmerged"]
