"""GRPO-LoRA end to end: torchrun + pretrain_grpo.py with LoRA on all four linears, the
reference as the shared backbone, adapter-only checkpoints; then the exports.

- every iteration: the rollout log-probs match training's (<= 1e-3, fp32), so vLLM runs
  the merged weights; the first update has no KL (B = 0: the actor is its backbone);
- the checkpoint holds the adapters only (and the base model's identity), and a resumed run
  repeats the uninterrupted one exactly;
- tools/convert_ckpt.py writes the merged HF model and a PEFT adapter directory: the merged
  model in transformers, and the adapter loaded with peft onto the base model, give the
  logits of megatron with adapters (<= 1e-4).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchrun_jobs import ROOT, run_job, stopped_at, training_rows

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing import run_on_ranks

pytestmark = pytest.mark.slow

CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
LORA = ["actor_config.lora_target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        "actor_config.lora_r=4", "actor_config.lora_alpha=8", "actor_config.lr=1e-3",
        "actor_config.lora_ckpt_filter=true", "rl_config.share_backbone=true"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_lora")
    train, _ = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl"}


def launch(assets, run, *overrides):
    return run_job(assets, run, *LORA, *overrides, launcher="pretrain_grpo.py", config=CONFIG,
                   nproc=2, timeout=900)


def _megatron_lora_logits(ckpt, tokens):
    from mindspeed_rl.checkpoint.convert import whole_model_parallel_state
    from mindspeed_rl.checkpoint.lora_export import load_lora_model
    from mindspeed_rl.checkpoint.weight_source import classify
    from mindspeed_rl.models.builder import build_model_from_hf_dir
    from mindspeed_rl.models.parity import megatron_logits

    with whole_model_parallel_state():
        model, arch, _ = build_model_from_hf_dir(ckpt)
        load_lora_model(model, arch, classify(ckpt, "test"))
        return megatron_logits(model, tokens)[..., :arch.vocab_size]


@pytest.fixture(scope="module")
def runs(assets):
    root = assets["root"]
    _, full = launch(assets, "full", "megatron_training.train_iters=3",
                     "megatron_training.save_interval=1", f"actor_config.save={root / 'full'}")
    stopped_at(root / "full", 2, root / "ckpt")
    _, resumed = launch(assets, "part", "megatron_training.train_iters=3",
                        f"actor_config.load={root / 'ckpt'}", f"actor_config.save={root / 'ckpt'}")
    return training_rows(full), training_rows(resumed)


def test_lora_run_learns_on_merged_weights_and_resumes_exactly(runs):
    full, resumed = runs
    assert sorted(full) == [1, 2, 3] and sorted(resumed) == [3]
    for row in full.values():
        assert row["rollout/logprob_abs_diff_max"] < 1e-3
        assert row["actor/grad_norm"] > 0
    assert full[3]["actor/kl_loss"] > 0
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
                "actor/entropy", "actor/grad_norm", "actor/lr"):
        assert resumed[3][key] == pytest.approx(full[3][key], rel=1e-6, abs=1e-9), key


def test_checkpoint_holds_the_adapters_only(assets, runs):
    from mindspeed_rl.checkpoint.megatron_dir import checkpoint_tensor_keys

    keys = checkpoint_tensor_keys(assets["root"] / "ckpt")
    model_keys = [k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    assert "decoder.layers.self_attention.linear_qkv.lora_B.weight" in keys   # layers stacked


def test_exports_give_megatron_logits(assets, runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = assets["root"]
    merged, adapter = root / "merged", root / "peft"
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"),
                    "--load-model-type", "mg", "--save-model-type", "hf",
                    "--load-dir", str(root / "ckpt"), "--save-dir", str(merged),
                    "--lora-adapter-dir", str(adapter), "--no-progress"],
                   check=True, capture_output=True, timeout=600)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = run_on_ranks(_megatron_lora_logits, 1, str(root / "ckpt"), tokens)[0]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
        merged_logits = hf(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(str(assets["model"]), dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, str(adapter))(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(
            str(assets["model"]), dtype=torch.float32)(tokens).logits
    assert (merged_logits - reference).abs().max().item() <= 1e-4
    assert (peft_logits - reference).abs().max().item() <= 1e-4
    assert (base_logits - reference).abs().max().item() > 1e-3   # the adapters trained
