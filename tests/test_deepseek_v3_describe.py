"""DeepSeek-V3's HF config -> megatron-core fields, and the configs that cannot map exactly
(refused naming the key)."""

from __future__ import annotations

import pytest

from mindspeed_rl.models.architecture import UnsupportedConfigError
from mindspeed_rl.models.builder import check_mla_tensor_parallel
from mindspeed_rl.models.registry import describe_model
from mindspeed_rl.models.tiny import tiny_config


def _fields(**overrides):
    return describe_model(tiny_config("deepseek_v3", **overrides)).transformer_config_kwargs


def test_tiny_config_maps_to_megatron_mla_and_deepseek_moe():
    tc = _fields()
    assert tc["multi_latent_attention"] and tc["q_lora_rank"] == 32 and tc["kv_lora_rank"] == 512
    assert (tc["qk_head_dim"], tc["qk_pos_emb_head_dim"], tc["v_head_dim"]) == (32, 64, 32)
    assert tc["rope_type"] == "yarn" and tc["rotary_scaling_factor"] == 4.0
    assert (tc["mscale"], tc["mscale_all_dim"], tc["original_max_position_embeddings"]) == (1.0, 0.8, 64)
    assert tc["moe_layer_freq"] == [0, 1, 1] and tc["moe_shared_expert_intermediate_size"] == 64
    assert tc["moe_router_score_function"] == "sigmoid" and tc["moe_router_enable_expert_bias"]
    assert (tc["moe_router_num_groups"], tc["moe_router_group_topk"], tc["moe_router_topk"]) == (2, 1, 2)
    assert tc["moe_router_topk_scaling_factor"] == 2.5
    assert tc["moe_router_load_balancing_type"] == "seq_aux_loss"


@pytest.mark.parametrize("overrides, key", [
    ({"topk_group": 3}, "topk_group"),                       # more groups picked than exist
    ({"num_experts_per_tok": 4}, "num_experts_per_tok"),      # groups ranked by top-2 vs top-4
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"rope_interleave": False}, "rope_interleave"),
])
def test_configs_megatron_cannot_reproduce_are_refused(overrides, key):
    with pytest.raises(UnsupportedConfigError, match=key):
        describe_model(tiny_config("deepseek_v3", **overrides))


def test_mla_dimension_not_divisible_by_tp_is_refused():
    tc = dict(_fields(q_lora_rank=30), tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 .* q_lora_rank=30"):
        check_mla_tensor_parallel(tc)
    check_mla_tensor_parallel(dict(_fields(), tensor_model_parallel_size=4))
