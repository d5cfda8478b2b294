"""Device detection: NPU if torch_npu imports, else CUDA, else CPU.

`setup_platform()` is called once per process before megatron-core is used. It
returns the device type and the collective backend, and installs whatever the
device needs: torch_npu and MindSpeed's megatron adaptor on Ascend, nothing on
CUDA, the scoped CPU adaptor (`cpu_adaptor.py`) on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_FORCE_ENV = "MINDSPEED_RL_DEVICE"  # cpu | cuda | npu: skip detection (e.g. CPU runs on a GPU box)


class PlatformError(RuntimeError):
    """The device stack is installed but unusable; the message names what failed."""


@dataclass(frozen=True)
class Platform:
    """The device this process trains and generates on."""

    device_type: str  # "npu" | "cuda" | "cpu"
    backend: str  # collective backend for torch.distributed: "hccl" | "nccl" | "gloo"

    @property
    def process_group_backend(self) -> str:
        """The world group's backend: on an accelerator its own for device tensors plus
        gloo for CPU tensors (metric sums, stop flags and counts are reduced as CPU
        tensors; NCCL and HCCL alone refuse them, and vLLM's external launcher asks for
        both)."""
        if self.device_type == "cpu":
            return self.backend
        return f"cpu:gloo,{self.device_type}:{self.backend}"

    def device(self, local_rank: int | None = None) -> torch.device:
        """This rank's device (the local rank picks the accelerator; CPU has one)."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(self.device_type, local_rank)

    @property
    def accelerator(self):
        """`torch.cuda` / `torch.npu`, or None on CPU (memory counters, synchronize)."""
        return None if self.device_type == "cpu" else getattr(torch, self.device_type)

    def set_device(self, local_rank: int | None = None) -> None:
        if self.accelerator is not None:
            self.accelerator.set_device(self.device(local_rank))

    def synchronize(self) -> None:
        if self.accelerator is not None:
            self.accelerator.synchronize()

    def max_memory_allocated(self) -> int | None:
        """Peak device bytes since the last reset, or None where the device has no counter."""
        return None if self.accelerator is None else int(self.accelerator.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        if self.accelerator is not None:
            self.accelerator.reset_peak_memory_stats()


_PLATFORM: Platform | None = None


def _import_or_explain(module: str, why: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - re-raised with the name of what failed
        raise PlatformError(
            f"`import {module}` failed ({type(exc).__name__}: {exc}). {why}"
        ) from exc


def _detect() -> str:
    forced = os.environ.get(_FORCE_ENV)
    if forced:
        if forced not in _BACKENDS:
            raise PlatformError(
                f"{_FORCE_ENV}={forced!r} is not a device; use one of {sorted(_BACKENDS)}"
            )
        return forced
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def detected_device_type() -> str:
    """The device a launch here would run on ("npu", "cuda" or "cpu"), without setting it up
    (the dry run's platform-dependent checks)."""
    return _detect()


def _setup_npu() -> None:
    _import_or_explain(
        "torch_npu",
        "torch_npu is installed but does not import: source the CANN environment "
        "(`source /usr/local/Ascend/ascend-toolkit/set_env.sh`), check that torch_npu matches "
        f"torch {torch.__version__}, or set {_FORCE_ENV}=cpu to run without the NPU.",
    )
    # Redirects torch.cuda.* calls in megatron-core to the NPU.
    _import_or_explain("torch_npu.contrib.transfer_to_npu",
                       "torch_npu is too old for transfer_to_npu; upgrade torch_npu.")
    # MindSpeed patches megatron-core for Ascend (fused kernels, HCCL specifics); it must
    # be imported before megatron builds any model. It reads its own options from sys.argv:
    # --use-flash-attn makes megatron's DotProductAttention run npu_fusion_attention
    # (mindspeed_rl.models.attention picks that class on NPU).
    if "--use-flash-attn" not in sys.argv:
        sys.argv.append("--use-flash-attn")
    _import_or_explain("mindspeed.megatron_adaptor",
                       "install MindSpeed (see requirements-npu.txt) matching megatron-core.")


# PyTorch's CPU allocator puts every tensor of 2 MiB or more in transparent huge pages when
# THP_MEM_ALLOC_ENABLE=1; it reads the variable once, at the process's first allocation of
# that size, so it is set before any. In 4 KiB pages each new large tensor pays one page
# fault per 4 KiB: allocating and zeroing a 113 MB tensor (SmolLM2's embedding gradient,
# made anew by every micro-batch's backward) took 130-290 ms on this project's CPU machines,
# 21-35 ms in 2 MiB pages (docs/performance.md). THP_MEM_ALLOC_ENABLE=0 keeps 4 KiB pages.
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def setup_platform() -> Platform:
    """Detect the device, install its megatron adaptor, return the Platform (idempotent)."""
    global _PLATFORM
    if _PLATFORM is not None:
        return _PLATFORM
    device_type = _detect()
    if device_type == "npu":
        _setup_npu()
    elif device_type == "cpu":
        from mindspeed_rl.platform import cpu_adaptor

        os.environ.setdefault(HUGE_PAGES_ENV, "1")
        cpu_adaptor.install()
    _PLATFORM = Platform(device_type=device_type, backend=_BACKENDS[device_type])
    return _PLATFORM
