"""Pure tests of the HF <-> megatron weight maps and config mappings (no megatron state)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models import weight_map as wm
from mindspeed_rl.models.architecture import UnsupportedConfigError
from mindspeed_rl.models.registry import UnsupportedArchitectureError, describe_model
from mindspeed_rl.models.tiny import ARCHS, tiny_config


def _geometry(heads=4, groups=2, d=3):
    return wm.AttentionGeometry(num_attention_heads=heads, num_query_groups=groups, head_dim=d,
                                vocab_size=10, padded_vocab_size=16)


def test_pack_qkv_interleaves_per_query_group():
    g = _geometry()  # 2 query heads per group, head_dim 3
    q = torch.arange(12.0).reshape(12, 1)          # heads 0..3
    k = 100 + torch.arange(6.0).reshape(6, 1)      # groups 0..1
    v = 200 + torch.arange(6.0).reshape(6, 1)
    fused = wm.pack_qkv(q, k, v, g).flatten().tolist()
    group0 = list(range(6)) + [100, 101, 102] + [200, 201, 202]
    group1 = list(range(6, 12)) + [103, 104, 105] + [203, 204, 205]
    assert fused == [float(x) for x in group0 + group1]


@pytest.mark.parametrize("rest", [(), (5,)])
def test_qkv_round_trip(rest):
    g = _geometry(heads=8, groups=2, d=4)
    q, k, v = torch.randn(32, *rest), torch.randn(8, *rest), torch.randn(8, *rest)
    out = wm.unpack_qkv(wm.pack_qkv(q, k, v, g), g)
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v)))


def test_to_hf_copies_only_when_asked():
    """to_hf owns its outputs by default (a converted checkpoint never aliases the model);
    copy=False (the resharding stream, whose reader copies) gives the same values as views
    wherever the layout allows, and copies no tensor twice either way."""
    arch = describe_model(tiny_config("llama"))
    mg = {n: torch.randn(*shape) for n, shape in [
        ("decoder.layers.0.mlp.linear_fc1.weight", (512, 128)),
        ("decoder.layers.0.self_attention.linear_proj.weight", (128, 128)),
        ("decoder.layers.0.self_attention.linear_qkv.weight", (256, 128)),
        ("embedding.word_embeddings.weight", (arch.padded_vocab_size, 128))]}

    def shares(t, source):
        return t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()

    views = 0
    for name, full in mg.items():
        owned = arch.weight_map.to_hf(name, full)
        light = arch.weight_map.to_hf(name, full, copy=False)
        assert [n for n, _ in owned] == [n for n, _ in light]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(owned, light))
        assert not any(shares(t, full) for _, t in owned)
        views += sum(shares(t, full) for _, t in light)
    assert views >= 4  # fc1's gate and up, linear_proj, the embedding: no copy


def test_gate_up_tp_split_keeps_gate_and_up_per_shard():
    arch = describe_model(tiny_config("llama"))
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = torch.randn(256, 128), torch.randn(256, 128)
    full = arch.weight_map.to_megatron(name, {"model.layers.0.mlp.gate_proj.weight": gate,
                                              "model.layers.0.mlp.up_proj.weight": up})
    shards = arch.weight_map.split_tp(name, full, 2)
    assert torch.equal(shards[0], torch.cat([gate[:128], up[:128]]))
    assert torch.equal(arch.weight_map.gather_tp(name, shards), full)


def test_vocab_padding_is_layout_independent_and_stripped_on_export():
    from mindspeed_rl.config.rank_parameters import padded_vocab_size

    assert padded_vocab_size(300) == 384 and padded_vocab_size(384) == 384
    arch = describe_model(tiny_config("qwen2", vocab_size=300))
    emb = torch.randn(300, 128)
    full = arch.weight_map.to_megatron("embedding.word_embeddings.weight", {"model.embed_tokens.weight": emb})
    assert full.shape == (384, 128) and torch.all(full[300:] == 0)
    [(name, back)] = arch.weight_map.to_hf("embedding.word_embeddings.weight", full)
    assert name == "model.embed_tokens.weight" and torch.equal(back, emb)


@pytest.mark.parametrize("arch_name", ARCHS)
def test_weight_map_covers_exactly_the_saved_hf_tensors(arch_name, tmp_path):
    from safetensors import safe_open

    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    overrides = {"mlp_only_layers": [1]} if arch_name == "qwen3_moe" else {}
    path = make_tiny_hf_dir(arch_name, tmp_path / arch_name, **overrides)
    arch = describe_model(tiny_config(arch_name, **overrides))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    assert set(arch.weight_map.all_hf_names()) == saved
    # Every HF tensor round-trips through its megatron parameter unchanged.
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for mg_name in arch.weight_map.megatron_names():
            hf = {h: f.get_tensor(h) for h in arch.weight_map.hf_names(mg_name)}
            back = dict(arch.weight_map.to_hf(mg_name, arch.weight_map.to_megatron(mg_name, hf)))
            assert back.keys() == hf.keys() and all(torch.equal(back[h], hf[h]) for h in hf)


def test_config_mapping_per_architecture():
    llama = describe_model(tiny_config("llama"))
    assert llama.share_embeddings_and_output_weights and llama.rotary_base == 100000.0
    assert "output_layer.weight" not in llama.weight_map.megatron_names()
    qwen2 = describe_model(tiny_config("qwen2"))
    assert qwen2.transformer_config_kwargs["add_qkv_bias"] and not qwen2.share_embeddings_and_output_weights
    qwen3 = describe_model(tiny_config("qwen3", head_dim=16))
    assert qwen3.transformer_config_kwargs["qk_layernorm"] and qwen3.transformer_config_kwargs["kv_channels"] == 16
    moe = describe_model(tiny_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0],
                                      decoder_sparse_step=2, norm_topk_prob=False))
    tc = moe.transformer_config_kwargs
    assert tc["moe_layer_freq"] == [0, 1, 0, 1]
    assert tc["num_moe_experts"] == 4 and tc["moe_router_topk"] == 2 and tc["moe_ffn_hidden_size"] == 64
    assert tc["moe_router_pre_softmax"] is True
    names = moe.weight_map.megatron_names()
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert not any(n.startswith("decoder.layers.0.mlp.experts") for n in names)


def test_unknown_architecture_lists_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitectureError, match="supported: llama.*qwen2.*qwen3.*qwen3_moe"):
        describe_model(GPT2Config())


def test_scaled_rope_is_refused():
    cfg = tiny_config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                "original_max_position_embeddings": 64})
    with pytest.raises(UnsupportedConfigError, match="yarn"):
        describe_model(cfg)


def test_sharded_safetensors_write_and_read(tmp_path):
    import shutil

    from mindspeed_rl.models.hf_io import INDEX_FILE, HFCheckpointReader, write_safetensors
    from mindspeed_rl.models.tiny import make_tiny_hf_dir

    src = make_tiny_hf_dir("qwen3", tmp_path / "src")
    reader = HFCheckpointReader(src)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(src / "config.json", out)
    files = write_safetensors(out, ((n, reader.get(n)) for n in reader.names()), max_shard_bytes=200_000)
    assert len(files) > 1 and (out / INDEX_FILE).is_file()
    back = HFCheckpointReader(out)
    assert sorted(back.names()) == sorted(reader.names())
    assert all(torch.equal(back.get(n), reader.get(n)) for n in reader.names())
