"""ParallelLayout arithmetic and its error messages (pure logic, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from mindspeed_rl.parallel import LayoutError, ParallelLayout


@pytest.mark.parametrize("kwargs, dp, dp_g, edp", [
    (dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
          infer_tensor_parallel_size=4), 2, 2, 2),
    (dict(world_size=4, expert_model_parallel_size=2), 4, 4, 2),
    (dict(world_size=16, tensor_model_parallel_size=4, sequence_parallel=True,
          expert_model_parallel_size=2, expert_tensor_parallel_size=1,
          infer_tensor_parallel_size=8), 4, 2, 8),
    (dict(world_size=1), 1, 1, 1),
    # CP joins TP x PP in the training tile; experts still spread over DP x CP
    (dict(world_size=16, tensor_model_parallel_size=2, context_parallel_size=2,
          pipeline_model_parallel_size=2, expert_model_parallel_size=2), 2, 16, 2),
])
def test_derived_sizes(kwargs, dp, dp_g, edp):
    layout = ParallelLayout(**kwargs)
    assert layout.data_parallel_size == dp
    assert layout.infer_data_parallel_size == dp_g
    assert layout.expert_data_parallel_size == edp
    assert str(layout.world_size) in layout.describe()


def test_frozen():
    layout = ParallelLayout(world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.world_size = 4


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=6, tensor_model_parallel_size=4),
     ["world_size=6", "tensor_model_parallel_size=4"]),
    (dict(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=3),
     ["world_size=8", "pipeline_model_parallel_size=3"]),
    (dict(world_size=4, infer_tensor_parallel_size=3),
     ["world_size=4", "infer_tensor_parallel_size=3"]),
    (dict(world_size=4, tensor_model_parallel_size=2, expert_model_parallel_size=4),
     ["world_size=4", "expert_model_parallel_size=4"]),
    (dict(world_size=2, sequence_parallel=True), ["sequence_parallel", "tensor_model_parallel_size"]),
    (dict(world_size=0), ["world_size=0"]),
    (dict(world_size=2, tensor_model_parallel_size="2"), ["tensor_model_parallel_size='2'"]),
    (dict(world_size=2, sequence_parallel=1), ["sequence_parallel=1"]),
])
def test_invalid_layouts_name_keys_and_world(kwargs, words):
    with pytest.raises(LayoutError) as err:
        ParallelLayout(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_model_checks():
    layout = ParallelLayout(world_size=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                            expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                            infer_tensor_parallel_size=8)
    layout.check_model(num_attention_heads=32, num_query_groups=8, num_layers=4, num_experts=8)
    with pytest.raises(LayoutError, match="infer_tensor_parallel_size=8 does not divide.*heads=12"):
        layout.check_model(num_attention_heads=12, num_query_groups=4, num_layers=4)
    with pytest.raises(LayoutError, match="pipeline_model_parallel_size=2 does not divide.*num_layers=3"):
        layout.check_model(num_attention_heads=32, num_query_groups=8, num_layers=3)
    with pytest.raises(LayoutError, match="expert_model_parallel_size=2 does not divide.*num_experts=3"):
        layout.check_model(num_attention_heads=32, num_query_groups=8, num_layers=4, num_experts=3)


def test_context_parallel_must_divide_what_tp_and_pp_leave():
    with pytest.raises(LayoutError, match=r"context_parallel_size=4 does not divide "
                       r"world_size=24 / \(tensor_model_parallel_size=2 x "
                       r"pipeline_model_parallel_size=2\) = 6 ranks"):
        ParallelLayout(world_size=24, tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=2, context_parallel_size=4)


def test_ulysses_heads_divide_tp_times_cp():
    layout = ParallelLayout(world_size=8, tensor_model_parallel_size=2, context_parallel_size=2)
    layout.check_model(num_attention_heads=12, num_query_groups=4, num_layers=2,
                       context_parallel_algo="ulysses_cp_algo")
    ring = ParallelLayout(world_size=2, context_parallel_size=2)  # SmolLM2's 9 heads
    ring.check_model(num_attention_heads=9, num_query_groups=3, num_layers=2,
                     context_parallel_algo="megatron_cp_algo")  # ring: no head split
    with pytest.raises(LayoutError, match="does not divide the model's num_attention_heads=9"):
        ring.check_model(num_attention_heads=9, num_query_groups=3, num_layers=2,
                         context_parallel_algo="ulysses_cp_algo")
    with pytest.raises(LayoutError, match="does not divide the model's num_key_value_heads=2"):
        layout.check_model(num_attention_heads=12, num_query_groups=2, num_layers=2,
                           context_parallel_algo="ulysses_cp_algo")
