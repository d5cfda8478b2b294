"""Block-quantised FP8 checkpoints (DeepSeek-V3's published form) dequantised on load.

DeepSeek-V3 / R1 ship their linear weights as ``float8_e4m3fn`` with one float32 scale per
128 x 128 block, stored next to the weight as ``<name>_scale_inv`` (shape
``[ceil(rows / 128), ceil(cols / 128)]``); config.json says so in ``quantization_config``
(``quant_method: fp8``, ``weight_block_size: [128, 128]``). The weight is
``fp8.float() * scale`` block by block, in bf16 as the checkpoint's own conversion script
writes it. `mindspeed_rl.models.hf_io.HFCheckpointReader` applies it per tensor, so a
conversion holds one tensor (and its scales) at a time, never a whole shard or model.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(hf_config) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 block-quantised checkpoint; None when it is not one."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        return None
    rows, cols = q.get("weight_block_size") or DEFAULT_BLOCK
    return int(rows), int(cols)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 ``weight`` [rows, cols] times its per-block ``scale_inv`` -> ``dtype``."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 block dequantisation needs 2-D weight and scale, got {tuple(weight.shape)} "
                         f"and {tuple(scale_inv.shape)}")
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 weight of shape {[rows, cols]} with {br}x{bc} blocks needs a scale of shape "
                         f"{list(expected)}, got {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (for tests and tools): [rows, cols] -> (float8_e4m3fn weight, float32 scale_inv),
    each block scaled so its largest magnitude maps to FP8's largest finite value."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = weight.float().new_zeros(nr * br, nc * bc)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale
