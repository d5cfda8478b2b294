"""Megatron models equal transformers: logit parity at TP/PP/EP layouts, bitwise round trips.

Tiny random HF models of the four architectures are generated once, converted to
megatron once (one spawned process), then one 4-rank gloo run loads each checkpoint at
every layout, checks logits against transformers, checks the TP/EP shards against the
weight map, re-saves at a sharded layout and reloads elsewhere.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from mindspeed_rl.testing.multiprocess import run_on_ranks
from mindspeed_rl.models.tiny import ARCHS, make_tiny_hf_dir

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
SEQ, BATCH = 32, 2
WORLD = 4
# qwen2 with a vocabulary that megatron pads (300 -> 384); qwen3_moe with one dense layer.
OVERRIDES = {"qwen2": {"vocab_size": 300}, "qwen3_moe": {"mlp_only_layers": [1]}}
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)]  # (TP, PP, EP)
LAYOUTS = {a: DENSE_LAYOUTS + ([(1, 1, 2), (2, 1, 2), (1, 2, 2)] if a == "qwen3_moe" else []) for a in ARCHS}
# Where the shard checks run and from where the checkpoint is re-saved.
SHARDED = {a: (2, 1, 2) if a == "qwen3_moe" else (2, 2, 1) for a in ARCHS}
CASES = [(a, layout) for a in ARCHS for layout in LAYOUTS[a]]


# ---- workers (module level: they run in spawned ranks) -------------------------------------

def _convert_all(cases):
    from mindspeed_rl.checkpoint.convert import convert

    for hf_dir, mg_dir, rt_dir in cases:
        convert("hf", "mg", hf_dir, mg_dir)
        convert("mg", "hf", mg_dir, rt_dir)


def _check_shards(model, arch, hf_dir) -> dict:
    """TP dims agree with megatron; HF weights loaded at this layout equal the dist-ckpt shards;
    `gather_tp` of the shards gives back the full HF-derived tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.models.builder import (
        build_gpt_model, build_transformer_config, global_parameter_names, load_hf_weights,
    )
    from mindspeed_rl.models.hf_io import HFCheckpointReader

    wm = arch.weight_map
    reader = HFCheckpointReader(hf_dir)
    direct = build_gpt_model(arch, build_transformer_config(arch))
    load_hf_weights(direct, arch, reader)
    bad_dims, bad_direct, bad_gather, n = [], [], [], 0
    for local, global_name in global_parameter_names(model).items():
        p = model.get_parameter(local)
        n += 1
        dim = wm.tp_dim(global_name)
        if getattr(p, "tensor_model_parallel", False) != (dim is not None) or (
                dim is not None and p.partition_dim != dim):
            bad_dims.append(global_name)
        if not torch.equal(p, direct.get_parameter(local)):
            bad_direct.append(global_name)
        if dim is not None:
            group = (ps.get_expert_tensor_parallel_group() if wm.is_expert(global_name)
                     else ps.get_tensor_model_parallel_group())
            shards = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, p.detach().contiguous(), group=group)
            full = wm.to_megatron(global_name, {h: reader.get(h) for h in wm.hf_names(global_name)})
            if not torch.equal(wm.gather_tp(global_name, shards), full):
                bad_gather.append(global_name)
    return {"params": n, "bad_dims": bad_dims, "bad_direct": bad_direct, "bad_gather": bad_gather}


def _parity_worker(cases, resave_root):
    import torch.distributed as dist

    from mindspeed_rl.checkpoint.megatron_dir import save_megatron_checkpoint, write_meta
    from mindspeed_rl.checkpoint.checkpoint_parity import load_megatron_model
    from mindspeed_rl.models.builder import describe_hf_dir
    from mindspeed_rl.models.hf_io import copy_metadata_files
    from mindspeed_rl.models.logit_parity import (
        max_abs_diff_global, megatron_logits, random_tokens, transformers_logits,
    )
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for arch_name, hf_dir, mg_dir in cases:
        arch = describe_hf_dir(mg_dir)
        vocab = arch.vocab_size
        tokens = random_tokens(vocab, BATCH, SEQ, seed=0)
        reference = transformers_logits(hf_dir, tokens)
        resaved = os.path.join(resave_root, arch_name)
        whole_logits = None
        for tp, pp, ep in LAYOUTS[arch_name] + [("resaved", 1, 1)]:
            source = resaved if tp == "resaved" else mg_dir
            layout = ParallelLayout(world, 1 if tp == "resaved" else tp, pp, ep)
            model, _ = load_megatron_model(source, layout)
            try:
                logits = megatron_logits(model, tokens)
                if tp == "resaved":
                    # Same weights as the original at the same layout: logits must be identical.
                    results[(arch_name, "resaved")] = max_abs_diff_global(
                        None if logits is None else logits - whole_logits)
                    continue
                results[(arch_name, (tp, pp, ep))] = max_abs_diff_global(
                    None if logits is None else logits[..., :vocab] - reference)
                if (tp, pp, ep) == (1, 1, 1):
                    whole_logits = logits
                if (tp, pp, ep) == SHARDED[arch_name]:
                    shard_report = _check_shards(model, arch, hf_dir)
                    reports = [None] * world
                    dist.all_gather_object(reports, shard_report)
                    results[(arch_name, "shards")] = reports
                    if rank == 0:
                        os.makedirs(resaved, exist_ok=True)
                        copy_metadata_files(mg_dir, resaved)
                        write_meta(resaved, arch.name)
                    dist.barrier()
                    save_megatron_checkpoint(model, resaved, iteration=7)
            finally:
                destroy_megatron_parallel()
    return results


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for a in ARCHS:
        hf = make_tiny_hf_dir(a, root / "hf" / a, seed=1, **OVERRIDES.get(a, {}))
        dirs[a] = (str(hf), str(root / "mg" / a), str(root / "hf_roundtrip" / a))
    run_on_ranks(_convert_all, 1, list(dirs.values()), timeout=600)
    return root, dirs


@pytest.fixture(scope="module")
def parity(converted):
    root, dirs = converted
    cases = [(a, dirs[a][0], dirs[a][1]) for a in ARCHS]
    results = run_on_ranks(_parity_worker, WORLD, cases, str(root / "resaved"), timeout=900)[0]
    table = {f"{a} {k}": v for (a, k), v in results.items() if k != "shards"}
    print("\nparity:", json.dumps({k: f"{v:.3e}" for k, v in table.items()}, indent=1))
    out = os.environ.get("MSRL_PARITY_JSON")
    if out:
        with open(out, "w") as f:
            json.dump({k: v for k, v in table.items()}, f, indent=1)
    return results


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_hf_mg_hf_round_trip_is_bitwise(converted, arch):
    from safetensors.torch import load_file

    _, dirs = converted
    hf, _, rt = dirs[arch]
    original, back = load_file(f"{hf}/model.safetensors"), load_file(f"{rt}/model.safetensors")
    assert sorted(original) == sorted(back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert open(f"{hf}/{f}").read() == open(f"{rt}/{f}").read()


def test_round_trip_dir_loads_in_transformers(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, dirs = converted
    rt = dirs["qwen3_moe"][2]
    model = AutoModelForCausalLM.from_pretrained(rt)
    tok = AutoTokenizer.from_pretrained(rt)
    ids = tok.apply_chat_template([{"role": "user", "content": "6 x 7?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert model(ids).logits.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("arch,layout", CASES, ids=[f"{a}-tp{t}pp{p}ep{e}" for a, (t, p, e) in CASES])
def test_logit_parity_with_transformers(parity, arch, layout):
    assert parity[(arch, layout)] <= TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_shards_match_weight_map(parity, arch):
    for report in parity[(arch, "shards")]:
        assert report["params"] > 0
        assert report["bad_dims"] == [] and report["bad_direct"] == [] and report["bad_gather"] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_resaved_at_sharded_layout_loads_at_another(parity, arch):
    assert parity[(arch, "resaved")] == 0.0
