"""Device-byte ledger of the resharding flow.

Every tensor the flow allocates, frees or swaps on the compute device is
recorded here by role (``train_param``, ``train_grad``, ``train_optimizer``,
``gen_weights``, ``bucket``, ``full_model``), so each transition reports its
peak device bytes. On CUDA/NPU the accelerator's ``max_memory_allocated`` is
reported beside it as a cross-check. On CPU, host and device are one memory
and vLLM-CPU cannot release its weights: there the ledger is the accounting
model of the protocol (what would be resident on a device), not RSS.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class TransitionReport:
    """What one reshard did: seconds, bytes moved between ranks / memories, peak bytes."""

    direction: str  # "to_infer" | "to_train"
    seconds: float = 0.0
    bytes_moved: int = 0  # collective traffic received + host<->device swap traffic
    bytes_received: int = 0  # of which collective traffic
    bytes_written: int = 0  # bytes written into the generation engine's weights
    floor_s: float = 0.0  # those bytes at this rank's measured bandwidths (floor.py)
    peak_bytes: int = 0  # ledger peak during the transition
    resident_bytes_before: int = 0
    resident_bytes_after: int = 0
    device_max_memory_allocated: int | None = None  # CUDA/NPU only

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ByteLedger:
    """Bytes resident on the device, by role; tracks the peak since the last reset."""

    def __init__(self) -> None:
        self.by_role: dict[str, int] = defaultdict(int)
        self.peak = 0

    @property
    def resident(self) -> int:
        return sum(self.by_role.values())

    def alloc(self, role: str, num_bytes: int) -> None:
        self.by_role[role] += int(num_bytes)
        self.peak = max(self.peak, self.resident)

    def free(self, role: str, num_bytes: int) -> None:
        self.by_role[role] -= int(num_bytes)
        if self.by_role[role] < 0:
            raise AssertionError(f"ledger: role {role!r} freed more bytes than it held")

    def set(self, role: str, num_bytes: int) -> None:
        """Declare a role's resident bytes (e.g. the generation weights after start-up)."""
        self.by_role[role] = int(num_bytes)
        self.peak = max(self.peak, self.resident)

    def reset_peak(self) -> None:
        self.peak = self.resident

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in self.by_role.items() if v}
