"""GRPO-LoRA end to end: torchrun + pretrain_grpo.py with LoRA on all four linears, the
reference as the shared backbone, adapter-only checkpoints; then the exports.

- every iteration: the rollout log-probs match training's (<= 1e-3, fp32), so vLLM runs
  the merged weights; the first update has no KL (B = 0: the actor is its backbone);
- the checkpoint holds the adapters only (and the base model's identity), and a resumed run
  repeats the uninterrupted one exactly;
- tools/convert_ckpt.py writes the merged HF model and a PEFT adapter directory: the merged
  model in transformers, and the adapter loaded with peft onto the base model, give the
  logits of megatron with the adapters in the training layout, TP = 2 as trained and
  TP = 2 x PP = 2 (<= 1e-5, fp32). A reference loaded at TP = 1 would carry any layout
  error of the export itself (linear_fc1's B was saved rank-interleaved);
- a resume at another TP is refused naming tensor_model_parallel_size; a checkpoint written
  in the old interleaved layout resumes exactly at its TP and exports correctly.
"""

from __future__ import annotations

import subprocess
import sys
import zlib

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


class _Adam:   # the OptimizerKeys a TrainableModel reads
    lr, min_lr, lr_decay_style, lr_warmup_fraction = 1e-2, 0.0, "constant", 0.0
    weight_decay, clip_grad, adam_beta1, adam_beta2 = 0.0, 0.0, 0.9, 0.95


def _lora_model(base_hf, lora):
    """This rank's stage of the base model with ``lora``'s adapters (in the current layout)."""
    from mindspeed_rl.engine.actor import build_policy_model
    from mindspeed_rl.models.builder import describe_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.models.lora import add_lora_adapters

    arch = describe_hf_dir(base_hf)
    model = build_policy_model(arch, params_dtype=torch.float32, sequence_parallel=False)
    load_hf_weights(model, arch, HFCheckpointReader(base_hf))
    add_lora_adapters(model, lora["target_modules"], lora["r"], lora["alpha"], seed=0)
    return model, arch


def _logits(model, arch, tokens):
    from mindspeed_rl.models.logit_parity import megatron_logits

    logits = megatron_logits(model, tokens)   # None on the stages without the output layer
    return None if logits is None else logits[..., :arch.vocab_size]


def _in_layout(tp, pp, body, *args):
    import torch.distributed as dist

    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(dist.get_world_size(), tp, pp, 1), seed=5)
    try:
        return body(*args)
    finally:
        destroy_megatron_parallel()


def _trained_logits(ckpt, base_hf, tokens):
    """The checkpoint's adapters on the base model, loaded in this layout."""
    from mindspeed_rl.checkpoint.lora_export import lora_common
    from mindspeed_rl.checkpoint.megatron_dir import load_megatron_checkpoint
    from mindspeed_rl.models.lora import is_adapter_name

    model, arch = _lora_model(base_hf, lora_common(ckpt, "latest")["lora"])
    load_megatron_checkpoint(model, ckpt, exclude=[k for k in model.state_dict()
                                                   if not is_adapter_name(k)])
    return _logits(model, arch, tokens)


def _resume_error(ckpt, base_hf):
    """A resume of the TP = 2 checkpoint in this layout: the error it raises."""
    from mindspeed_rl.checkpoint.lora_export import lora_common
    from mindspeed_rl.checkpoint.trainer_state import load_trainer_checkpoint
    from mindspeed_rl.engine.optim import TrainableModel
    from mindspeed_rl.errors import CheckpointError

    model, _ = _lora_model(base_hf, lora_common(ckpt, "latest")["lora"])
    actor = TrainableModel(model, _Adam(), total_steps=2, bf16=False,
                           use_distributed_optimizer=True)
    actor.checkpoint_adapters_only = True
    with pytest.raises(CheckpointError) as e:
        load_trainer_checkpoint(ckpt, {"actor": actor})
    return str(e.value)


def _old_layout_checkpoint(base_hf, save, tokens):
    """A LoRA checkpoint as earlier versions of this project wrote it (linear_fc1's B rank-
    interleaved, no layout records) from trained-looking adapters (B != 0); returns the
    adapted logits and those of a resume of it at the same TP."""
    from unittest import mock

    from megatron.core import parallel_state as ps

    from mindspeed_rl.checkpoint import trainer_state
    from mindspeed_rl.checkpoint.weight_source import HF, WeightSource
    from mindspeed_rl.engine.optim import TrainableModel
    from mindspeed_rl.models import lora as lora_module

    lora = {"target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            "r": 4, "alpha": 8}
    model, arch = _lora_model(base_hf, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:   # TP-split rows differ per rank, replicated ones agree
                rank = ps.get_tensor_model_parallel_rank() if p.tensor_model_parallel else 0
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + rank)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    expected = _logits(model, arch, tokens)
    actor = TrainableModel(model, _Adam(), total_steps=2, bf16=False,
                           use_distributed_optimizer=True)
    actor.checkpoint_adapters_only = True
    common = {"initial_weights": WeightSource(HF, str(base_hf), None, "test").to_dict()}
    with lora_module.rank_local_fc1_rows(model), \
            mock.patch.object(lora_module, "FC1_B_LAYOUT_KEY", "not_written_then"), \
            mock.patch.object(trainer_state, "_parallel_layout", dict):
        trainer_state.save_trainer_checkpoint(save, 1, {"actor": actor}, common=common,
                                              hf_files_from=base_hf, architecture=arch.name)
    again, _ = _lora_model(base_hf, lora)
    resumed = TrainableModel(again, _Adam(), total_steps=2, bf16=False,
                             use_distributed_optimizer=True)
    resumed.checkpoint_adapters_only = True
    trainer_state.load_trainer_checkpoint(save, {"actor": resumed})
    return expected, _logits(again, arch, tokens)


def _two_rank_checks(ckpt, base_hf, old, tokens):
    return {"tp2": _in_layout(2, 1, _trained_logits, ckpt, base_hf, tokens),
            "resume_tp1": _in_layout(1, 1, _resume_error, ckpt, base_hf),
            "old": _in_layout(2, 1, _old_layout_checkpoint, base_hf, old, tokens)}


def _export(ckpt, out):
    merged, adapter = out / "merged", out / "peft"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"),
                           "--load-model-type", "mg", "--save-model-type", "hf",
                           "--load-dir", str(ckpt), "--save-dir", str(merged),
                           "--lora-adapter-dir", str(adapter), "--no-progress"],
                          check=True, capture_output=True, text=True, timeout=600)
    return merged, adapter, done.stderr


def _hf_logits(merged, adapter, base_hf, tokens):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        merged_logits = AutoModelForCausalLM.from_pretrained(str(merged),
                                                             dtype=torch.float32)(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(str(base_hf), dtype=torch.float32)
        peft_logits = PeftModel.from_pretrained(base, str(adapter))(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(str(base_hf),
                                                           dtype=torch.float32)(tokens).logits
    return merged_logits, peft_logits, base_logits


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


@pytest.fixture(scope="module")
def layouts(assets, runs):
    """The TP = 2 run's checkpoint in the training layouts (TP = 2 on 2 ranks, TP = 2 x PP = 2
    on 4), a resume of it at TP = 1, and a checkpoint in the old layout."""
    root = assets["root"]
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    args = (str(root / "ckpt"), str(assets["model"]))
    two = run_on_ranks(_two_rank_checks, 2, *args, str(root / "old"), tokens)[0]
    four = run_on_ranks(_in_layout, 4, 2, 2, _trained_logits, *args, tokens)
    return dict(two, tp2_pp2=next(x for x in four if x is not None), tokens=tokens)


def test_exports_give_the_training_layout_logits(assets, layouts):
    root = assets["root"]
    merged, adapter, _ = _export(root / "ckpt", root / "export")
    merged_logits, peft_logits, base_logits = _hf_logits(merged, adapter, assets["model"],
                                                         layouts["tokens"])
    diffs = {(export, layout): (logits - layouts[layout]).abs().max().item()
             for export, logits in (("merged", merged_logits), ("peft", peft_logits))
             for layout in ("tp2", "tp2_pp2")}
    print("export vs training-layout logits, max |diff|:", diffs)
    assert all(diff <= 1e-5 for diff in diffs.values()), diffs
    assert (base_logits - layouts["tp2"]).abs().max().item() > 1e-3   # the adapters trained


def test_resume_at_another_tp_is_refused(layouts):
    message = layouts["resume_tp1"]
    assert "was saved with actor_config.tensor_model_parallel_size=2 and this run has " \
           "actor_config.tensor_model_parallel_size=1" in message, message
    assert "set actor_config.tensor_model_parallel_size: 2" in message


def test_old_layout_checkpoint_resumes_and_exports_correctly(assets, layouts):
    expected, resumed = layouts["old"]
    assert torch.equal(resumed, expected)   # resumed at its TP, B read as it was written
    root = assets["root"]
    merged, adapter, log = _export(root / "old", root / "old_export")
    assert "regrouped from the rank-interleaved layout" in log, log
    merged_logits, peft_logits, _ = _hf_logits(merged, adapter, assets["model"],
                                               layouts["tokens"])
    assert (merged_logits - expected).abs().max().item() <= 1e-5
    assert (peft_logits - expected).abs().max().item() <= 1e-5
