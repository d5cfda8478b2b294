"""FP8 block-quantised HF checkpoints (DeepSeek-V3's published form: float8_e4m3fn weights with
a float32 ``weight_scale_inv`` per 128 x 128 block) read dequantised, and converted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mindspeed_rl.errors import CheckpointError
from mindspeed_rl.models.fp8_weights import quantize
from mindspeed_rl.models.hf_io import HFCheckpointReader
from mindspeed_rl.models.tiny import make_tiny_hf_dir, tiny_config

ROOT = Path(__file__).resolve().parents[1]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
NAME = "model.layers.0.mlp.down_proj.weight"


def _fp8_dir(path: Path, tensors: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tiny_config("deepseek_v3", quantization_config=FP8_CONFIG).save_pretrained(str(path))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _expected(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block, as DeepSeek's fp8_cast_bf16 does: fp8 * scale of its block, in bf16."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out.to(torch.bfloat16)


def test_fp8_shard_reads_as_its_dequantised_bf16_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    # 300 x 200: edge blocks are partial; blocks of very different magnitudes get their own scales.
    w = torch.randn(300, 200, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(100)[:, None]
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    reader = HFCheckpointReader(_fp8_dir(tmp_path / "fp8", {NAME: q, NAME + "_scale_inv": scale,
                                                            "model.norm.weight": torch.ones(8)}))
    assert sorted(reader.names()) == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    assert reader.dtype(NAME) == torch.bfloat16 and reader.raw_dtype(NAME) == torch.float8_e4m3fn
    got = reader.get(NAME)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _expected(q, scale))
    # and it is the original weight up to FP8's precision (3 mantissa bits) within each block
    block_amax = w.abs().view(3, 100, 2, 100).amax(dim=(1, 3)).repeat_interleave(100, 0).repeat_interleave(100, 1)
    assert ((got.float() - w).abs() / block_amax).max() < 2 ** -4
    assert torch.equal(reader.get("model.norm.weight"), torch.ones(8))


def test_fp8_scale_of_wrong_shape_or_missing_is_refused(tmp_path):
    q, scale = quantize(torch.randn(300, 200))
    bad = HFCheckpointReader(_fp8_dir(tmp_path / "bad", {NAME: q, NAME + "_scale_inv": scale[:2]}))
    with pytest.raises(CheckpointError, match=r"down_proj.weight.*scale of shape \[3, 2\]"):
        bad.get(NAME)
    with pytest.raises(CheckpointError, match=r"down_proj.weight_scale_inv"):
        HFCheckpointReader(_fp8_dir(tmp_path / "missing", {NAME: q}))


def _convert(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_ckpt.py"), "--no-progress", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_fp8_deepseek_v3_converts_to_megatron_and_back_dequantised(tmp_path):
    hf = make_tiny_hf_dir("deepseek_v3", tmp_path / "hf", seed=2)
    tensors, fp8 = load_file(str(hf / "model.safetensors")), {}
    for name, t in tensors.items():  # as DeepSeek ships: the linear layers' weights in FP8
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            fp8[name], fp8[name + "_scale_inv"] = quantize(t)
        else:
            fp8[name] = t
    src = _fp8_dir(tmp_path / "fp8", fp8)
    _convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(src),
             "--save-dir", str(tmp_path / "mg"))
    _convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg"),
             "--save-dir", str(tmp_path / "back"), "--save-dtype", "bfloat16")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(tensors)
    n_fp8 = 0
    for name, t in back.items():
        if name + "_scale_inv" in fp8:
            n_fp8 += 1
            assert torch.equal(t, _expected(fp8[name], fp8[name + "_scale_inv"])), name
        elif not name.endswith("e_score_correction_bias"):  # kept float32
            assert torch.equal(t, fp8[name].to(torch.bfloat16)), name
    assert n_fp8 > 20
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
