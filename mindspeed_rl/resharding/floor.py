"""The resharding's floor: each rank's bytes moved once, at bandwidths measured on this rank.

A transition moves three kinds of bytes on a rank:

* **received** from its peers (TP all-gather, EP gather, PP broadcast:
  ``WeightStream.bytes_received``), at the bandwidth of an all-gather over the world group;
* **swapped** between device and host (the training state, ``StateSwapper.bytes_moved``),
  at the device -> host copy bandwidth;
* **written** into the generation engine's weights (``engine.weight_bytes()``, once per
  ``to_infer``), at the device copy bandwidth.

Its floor is the sum of the three at those bandwidths: the time the transition would take if
it did nothing but move each byte once. The trainer logs it beside the measured time
(``perf/resharding_to_infer_floor_s``, ``perf/resharding_to_train_floor_s``). What a real
transition adds on top is the generation engine's own work after a load (vLLM-CPU repacks
every linear layer's weight for oneDNN), renaming and Python (docs/performance.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MIB = 1024 ** 2


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of one rank: received in a collective, copied to host, copied on
    the device."""

    collective: float
    host_copy: float
    device_copy: float

    def floor_s(self, *, received: int, swapped: int, written: int) -> float:
        return received / self.collective + swapped / self.host_copy + written / self.device_copy


def _copy_rate(src: torch.Tensor, dst: torch.Tensor, sync, seconds: float) -> float:
    """Bytes per second of ``dst.copy_(src)``, after one warm-up copy."""
    dst.copy_(src)
    sync()
    count, start = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - start < seconds:
        dst.copy_(src)
        count += 1
        sync()
    return src.nbytes * count / (time.perf_counter() - start)


def _collective_rate(chunk: torch.Tensor, repeats: int) -> float:
    """Bytes per second one rank receives in an all-gather of ``chunk`` over the world (the
    slowest rank's rate); infinite without peers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float("inf")
    world = dist.get_world_size()
    out = [torch.empty_like(chunk) for _ in range(world)]
    dist.all_gather(out, chunk)  # warm-up (and connection set-up)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather(out, chunk)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return chunk.nbytes * (world - 1) * repeats / elapsed.item()


def measure_bandwidths(device: torch.device | str = "cpu", *, nbytes: int = 32 * MIB,
                       seconds: float = 0.1, repeats: int = 3) -> Bandwidths:
    """The three bandwidths, measured now (every rank calls it: the all-gather is
    collective). About 0.3 s on a 2-core CPU with 2 ranks."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                       pin_memory=device.type == "cuda")
    device_copy = _copy_rate(src, torch.empty_like(src), sync, seconds)
    host_copy = device_copy if device.type == "cpu" else _copy_rate(src, host, sync, seconds)
    # the weight stream's collectives run on the device where the backend takes it (NCCL,
    # HCCL), on host tensors under gloo
    on_device = device.type != "cpu" and dist.is_initialized() and dist.get_backend() != "gloo"
    chunk_device = device if on_device else "cpu"
    collective = _collective_rate(torch.ones(nbytes // 4, dtype=torch.uint8,
                                             device=chunk_device), repeats)
    return Bandwidths(collective=collective, host_copy=host_copy, device_copy=device_copy)
