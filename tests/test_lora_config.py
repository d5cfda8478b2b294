"""LoRA's keys (MindSpeed-RL's names and meaning), their bad input and the memory plan
(pure Python, before any process group)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mindspeed_rl.config import load_config, make_plan
from mindspeed_rl.config.config_error import ConfigErrors
from tests.test_config import TINY_MODEL, error_of, job  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[1]
MSRL = Path("/work/.mirror/Ascend+MindSpeed-RL/repo")
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def lora(**actor):
    return {"lora_target_modules": ALL, "lora_r": 4, "lora_alpha": 8, **actor}


def test_keys_load_with_their_meaning(job):
    config = load_config(job(actor_config=lora(lora_fusion=True, lora_ckpt_filter=True),
                             rl_config={"share_backbone": True}))
    a = config.actor_config
    assert (a.lora_target_modules, a.lora_r, a.lora_alpha, a.lora_fusion,
            a.lora_ckpt_filter) == (tuple(ALL), 4, 8, True, True)
    assert config.rl_config.share_backbone


def test_megatron_training_keys_and_lora_filter_move_to_the_actor(job):
    config = load_config(job(megatron_training={"lora_r": 2, "lora_alpha": 2, "lora_filter": True,
                                                "lora_target_modules": ["linear_qkv"]}))
    a = config.actor_config
    assert (a.lora_r, a.lora_target_modules, a.lora_ckpt_filter) == (2, ("linear_qkv",), True)


@pytest.mark.parametrize("actor, rl, key, words", [
    (lora(lora_r=0), {}, "actor_config.lora_r", "positive integer"),
    (lora(lora_r=-4), {}, "actor_config.lora_r", "positive integer"),
    (lora(lora_alpha=0), {}, "actor_config.lora_alpha", "greater than 0"),
    (lora(lora_target_modules=["linear_qkv", "q_proj"]), {}, "actor_config.lora_target_modules",
     "megatron's name 'linear_qkv'"),
    (lora(lora_target_modules=["linear_qkvz"]), {}, "actor_config.lora_target_modules",
     "is not a linear of the model"),
    ({"lora_ckpt_filter": True}, {}, "actor_config.lora_ckpt_filter", "is empty"),
    ({}, {"share_backbone": True}, "rl_config.share_backbone", "lora_target_modules is empty"),
    (lora(), {"share_backbone": True, "init_kl_coef": 0.0}, "rl_config.share_backbone",
     "no reference model"),
])
def test_bad_input_names_the_key(job, actor, rl, key, words):
    text = error_of(load_config, job(actor_config=actor, rl_config=rl))
    assert text.startswith(key) and words in text, text


def test_share_backbone_refused_for_a_dapo_stage(job):
    with pytest.raises(ConfigErrors) as e:
        load_config(job(megatron_training={"stage": "ray_dapo"}, actor_config=lora(),
                        rl_config={"share_backbone": True}))
    assert "rl_config.share_backbone" in str(e.value) and "DAPO" in str(e.value)


def test_moe_model_has_no_dense_mlp_to_adapt(job, tmp_path):
    import yaml

    moe = dict(TINY_MODEL, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    (tmp_path / "model" / "tiny.yaml").write_text(yaml.safe_dump(moe))
    text = error_of(load_config, job(actor_config=lora()))
    assert text.startswith("actor_config.lora_target_modules") and "experts" in text
    load_config(job(actor_config=lora(lora_target_modules=["linear_qkv", "linear_proj"])))


def test_memory_plan_counts_adapters_and_no_reference(job):
    full = make_plan(load_config(job(megatron_training={"bf16": True})), 4).to_dict()
    config = load_config(job(megatron_training={"bf16": True}, actor_config=lora(),
                             rl_config={"share_backbone": True}))
    plan = make_plan(config, 4)
    d = plan.to_dict()
    # TINY_MODEL at TP=2, r=4: qkv A 4*64 + B (2+2*1)*16*4; proj A 4*64/2 + B 64*4;
    # fc1 A 4*64 + B 2*128/2*4; fc2 A 4*128/2 + B 64*4; two layers.
    per_layer = (256 + 256) + (128 + 256) + (256 + 512) + (256 + 256)
    assert d["parameters"]["adapter_per_rank"] == 2 * per_layer == 4352
    base = d["parameters"]["training_per_rank"]
    mem = d["memory_bytes"]
    assert mem["actor_params"] == (base + 4352) * 2
    assert mem["actor_grads"] == 4352 * 4                     # adapters only
    assert mem["actor_optimizer"] == 4352 * 12                # master + m + v, replicated
    assert mem["reference_params"] == 0 and full["memory_bytes"]["reference_params"] == base * 2
    text = plan.format()
    assert "share_backbone: the actor with its adapters off; no weights" in text
    assert "LoRA adapters (trained)" in text


@pytest.mark.skipif(not MSRL.exists(), reason="no MindSpeed-RL mirror")
def test_mindspeed_rl_lora_config_passes_the_dry_run(tmp_path):
    """Their grpo_lora_qwen25_32b_A2.yaml, unchanged, at its world size (16)."""
    (tmp_path / "model").mkdir()
    for path in ("configs/grpo_lora_qwen25_32b_A2.yaml", "configs/model/qwen25_32b.yaml"):
        text = subprocess.run(["git", "-C", str(MSRL), "show", f"HEAD:{path}"], check=True,
                              capture_output=True, text=True).stdout
        (tmp_path / path.removeprefix("configs/")).write_text(text)
    config = load_config(tmp_path / "grpo_lora_qwen25_32b_A2.yaml", check_data=False)
    a = config.actor_config
    assert (a.lora_r, a.lora_alpha, a.lora_fusion, a.lora_ckpt_filter) == (128, 128, True, True)
    assert a.lora_target_modules == tuple(ALL) and config.rl_config.share_backbone
    plan = make_plan(config, 16).to_dict()
    assert plan["memory_bytes"]["reference_params"] == 0
    assert plan["parameters"]["adapter_per_rank"] == 90_701_824
