"""DeepSeek-V3 (multi-latent attention with YaRN, sigmoid router with expert bias, group-limited
top-k, shared experts, dense first layer) built from megatron-core equals transformers.

A tiny random `DeepseekV3ForCausalLM` is converted to megatron and back with
tools/convert_ckpt.py (as a user runs it), then one 2-rank gloo run loads the checkpoint at
TP 1, TP 2, EP 2 and PP 2 with uneven stages ("1,2") and compares the logits with
transformers' (fp32). The same run saves the TP 2 model as MindSpeed-LLM names MLA in its
legacy checkpoints and loads those at EP 2, and in its torch_dist checkpoints, loaded at TP 2
and at PP 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4
SEQ, BATCH = 32, 2
# (TP, PP, EP, num_layer_list) on 2 ranks; PP 2 puts 1 layer on the first stage and 2 on the last.
LAYOUTS = [(1, 1, 1, None), (2, 1, 1, None), (1, 1, 2, None), (1, 2, 1, "1,2")]
# MindSpeed-LLM's names for MLA in its checkpoints: older releases, --mla-mm-split, and older
# with the experts as --moe-grouped-gemm saves them.
MINDSPEED_LLM_STYLES = ("older", "mm_split", "grouped_gemm")
# ... and in its torch_dist checkpoints (megatron-core's sharded state dict of its MLA modules).
TORCH_DIST_STYLES = ("older", "mm_split")


def _convert(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"), "--no-progress", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _write_mtp_layer(hf_dir: Path, config) -> None:
    """A published checkpoint's multi-token-prediction layer: tensors of layer num_hidden_layers."""
    from safetensors.torch import save_file

    n = config.num_hidden_layers
    save_file({f"model.layers.{n}.enorm.weight": torch.ones(config.hidden_size),
               f"model.layers.{n}.eh_proj.weight": torch.zeros(config.hidden_size, 2 * config.hidden_size)},
              str(hf_dir / "mtp.safetensors"))


# ---- workers (module level: they run in spawned ranks) -------------------------------------

def _parity_worker(hf_dir, mg_dir, mindspeed_llm_dir):
    from mindspeed_rl.checkpoint.checkpoint_parity import load_megatron_model
    from mindspeed_rl.models.logit_parity import (max_abs_diff_global, megatron_logits,
                                                  random_tokens, transformers_logits)
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout

    import test_models_parity

    results = {}
    tokens = reference = None
    for tp, pp, ep, num_layer_list in LAYOUTS:
        model, arch = load_megatron_model(mg_dir, ParallelLayout(2, tp, pp, ep), num_layer_list=num_layer_list)
        try:
            if reference is None:
                tokens = random_tokens(arch.vocab_size, BATCH, SEQ, seed=0)
                reference = transformers_logits(hf_dir, tokens)
            logits = megatron_logits(model, tokens)
            diff = None if logits is None else logits[..., :arch.vocab_size] - reference
            results[(tp, pp, ep)] = max_abs_diff_global(diff)
            results[(tp, pp, ep, "layers")] = sorted(layer.layer_number for layer in model.decoder.layers)
            if tp == 2:
                results["shards"] = test_models_parity._check_shards(model, arch, hf_dir)
                # MindSpeed-LLM's own checkpoints of this model (its MLA names), saved at TP 2.
                from legacy_megatron_ckpt import mindspeed_llm_mla_state, write_rank_file

                for style in MINDSPEED_LLM_STYLES:
                    write_rank_file(mindspeed_llm_mla_state(model, model.config, style), model.config,
                                    f"{mindspeed_llm_dir}/{style}", iteration=3)
                from legacy_megatron_ckpt import save_mindspeed_llm_torch_dist

                for style in TORCH_DIST_STYLES:
                    save_mindspeed_llm_torch_dist(model, model.config, style,
                                                  f"{mindspeed_llm_dir}/torch_dist_{style}", iteration=5)
                    results[("mindspeed_llm_torch_dist", style, "tp2")] = _reloaded_diff(
                        model, f"{mindspeed_llm_dir}/torch_dist_{style}", tokens, reference, arch)
            if ep == 2:
                # ... read at EP 2 into a model whose weights were zeroed first.
                from mindspeed_rl.checkpoint.legacy_megatron import load_legacy_megatron_checkpoint

                for style in MINDSPEED_LLM_STYLES:
                    with torch.no_grad():
                        for t in list(model.parameters()) + [b for n, b in model.named_buffers()
                                                             if n.endswith("expert_bias")]:
                            t.zero_()
                    load_legacy_megatron_checkpoint(model, arch, f"{mindspeed_llm_dir}/{style}")
                    diff = megatron_logits(model, tokens)[..., :arch.vocab_size] - reference
                    results[("mindspeed_llm", style)] = max_abs_diff_global(diff)
            if pp == 2:
                # ... and its torch_dist checkpoints, read at PP 2 with uneven stages.
                for style in TORCH_DIST_STYLES:
                    results[("mindspeed_llm_torch_dist", style, "pp2")] = _reloaded_diff(
                        model, f"{mindspeed_llm_dir}/torch_dist_{style}", tokens, reference, arch)
            if (tp, pp, ep) == (1, 1, 1):
                # A model started from another (the trainer's reference from the policy) gets
                # its weight buffers too.
                from mindspeed_rl.models.builder import build_gpt_model, build_transformer_config, copy_model_weights

                twin = build_gpt_model(arch, build_transformer_config(arch))
                copy_model_weights(twin, model)
                results["copied"] = max_abs_diff_global(megatron_logits(twin, tokens)[..., :arch.vocab_size] - reference)
                # The router's expert bias is wired: without it the routes (and logits) change.
                for name, buf in model.named_buffers():
                    if name.endswith("router.expert_bias"):
                        buf.zero_()
                logits = megatron_logits(model, tokens)
                results["no_expert_bias"] = max_abs_diff_global(logits[..., :arch.vocab_size] - reference)
        finally:
            destroy_megatron_parallel()
    return results


def _reloaded_diff(model, torch_dist_dir, tokens, reference, arch) -> float:
    """The logits' largest difference from ``reference`` after ``model``'s weights were
    zeroed and loaded from the torch_dist checkpoint ``torch_dist_dir``."""
    from mindspeed_rl.checkpoint.megatron_dir import load_megatron_checkpoint
    from mindspeed_rl.models.logit_parity import max_abs_diff_global, megatron_logits

    with torch.no_grad():
        for t in model.parameters():
            t.zero_()
    load_megatron_checkpoint(model, torch_dist_dir)
    logits = megatron_logits(model, tokens)
    return max_abs_diff_global(None if logits is None else logits[..., :arch.vocab_size] - reference)


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    hf = make_tiny_hf_dir("deepseek_v3", root / "hf", seed=1)
    from transformers import AutoConfig

    _write_mtp_layer(hf, AutoConfig.from_pretrained(str(hf)))
    mg, rt = root / "mg", root / "hf_roundtrip"
    to_mg = _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf), "--save-dir", str(mg))
    _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg), "--save-dir", str(rt))
    return hf, mg, rt, to_mg.stderr


@pytest.fixture(scope="module")
def parity(converted):
    hf, mg, _, _ = converted
    results = run_on_ranks(_parity_worker, 2, str(hf), str(mg), str(mg.parent / "mindspeed_llm"),
                           timeout=900)[0]
    print("\ndeepseek_v3 parity:", json.dumps({str(k): v for k, v in results.items() if k != "shards"}))
    return results


# ---- tests -------------------------------------------------------------------------------------

def test_hf_mg_hf_round_trip_is_bitwise(converted):
    from safetensors.torch import load_file

    hf, _, rt, _ = converted
    original, back = load_file(str(hf / "model.safetensors")), load_file(str(rt / "model.safetensors"))
    assert sorted(original) == sorted(back)
    assert any(name.endswith("e_score_correction_bias") for name in back)
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_multi_token_prediction_layer_is_skipped_with_one_line(converted):
    *_, log = converted
    lines = [line for line in log.splitlines() if "multi-token-prediction" in line]
    assert len(lines) == 1 and "skipping 2 tensor(s)" in lines[0], log[-2000:]


@pytest.mark.parametrize("layout", [l[:3] for l in LAYOUTS], ids=["tp1", "tp2", "ep2", "pp2-uneven"])
def test_logit_parity_with_transformers(parity, layout):
    assert parity[layout] <= TOLERANCE


def test_uneven_pipeline_stages_hold_their_layers(parity):
    # ranks report their own stage; rank 0 is the first stage: layer 1 only ("1,2").
    assert parity[(1, 2, 1, "layers")] == [1]


def test_tensor_parallel_shards_match_weight_map(parity):
    report = parity["shards"]
    assert report["params"] > 0
    assert report["bad_dims"] == [] and report["bad_direct"] == [] and report["bad_gather"] == []


def test_router_expert_bias_changes_the_routes(parity):
    assert parity["no_expert_bias"] > 100 * TOLERANCE


def test_model_copied_from_another_keeps_its_router_bias(parity):
    assert parity["copied"] <= TOLERANCE


@pytest.mark.parametrize("style", MINDSPEED_LLM_STYLES)
def test_mindspeed_llm_checkpoint_with_its_mla_names_loads(converted, parity, style):
    """A MindSpeed-LLM legacy checkpoint of the model (saved at TP 2 under its own MLA names)
    loads at EP 2 to transformers' logits."""
    from mindspeed_rl.checkpoint.legacy_megatron import read_legacy_file

    _, mg, _, _ = converted
    names = read_legacy_file(mg.parent / "mindspeed_llm" / style / "iter_0000003" / "mp_rank_01"
                             / "model_optim_rng.pt")["model"]
    theirs = {"older": ("linear_qkv", "linear_qb", "linear_kvb", "k_layernorm"),
              "mm_split": ("linear_qkv", "linear_qk_nope", "linear_qk_rope", "linear_kv_nope", "linear_v"),
              "grouped_gemm": ("linear_qkv", "linear_qb", "linear_kvb", "k_layernorm")}
    for module in theirs[style]:
        assert any(f"self_attention.{module}." in n for n in names), (module, sorted(names)[:20])
    assert not any("linear_q_down_proj" in n or "linear_kv_up_proj" in n for n in names)
    grouped = any(n.endswith("mlp.experts.weight1") for n in names)
    assert grouped == (style == "grouped_gemm") and grouped != any("local_experts" in n for n in names)
    assert parity[("mindspeed_llm", style)] <= TOLERANCE


@pytest.mark.parametrize("style", TORCH_DIST_STYLES)
def test_mindspeed_llm_torch_dist_checkpoint_with_its_mla_names_loads(converted, parity, style):
    """A MindSpeed-LLM torch_dist checkpoint of the model (saved at TP 2, its MLA tensors under
    its own names) loads at TP 2, and at PP 2 with uneven stages, to transformers' logits."""
    from megatron.core import dist_checkpointing

    _, mg, _, _ = converted
    stored = set(dist_checkpointing.load_tensors_metadata(
        str(mg.parent / "mindspeed_llm" / f"torch_dist_{style}" / "iter_0000005")))
    theirs = {"older": ("linear_qkv", "linear_qb", "linear_kvb", "k_layernorm"),
              "mm_split": ("linear_qkv", "linear_qk_nope", "linear_qk_rope", "linear_kv_nope", "linear_v")}
    assert {f"decoder.layers.1.self_attention.{m}.weight" for m in theirs[style]} <= stored, sorted(stored)
    assert not any("linear_q_down_proj" in n or "linear_kv_up_proj" in n for n in stored)
    assert parity[("mindspeed_llm_torch_dist", style, "tp2")] <= TOLERANCE
    assert parity[("mindspeed_llm_torch_dist", style, "pp2")] <= TOLERANCE
