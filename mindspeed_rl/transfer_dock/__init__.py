"""TransferDock: the sample flow of the RL iteration (docs/transfer_dock.md).

Controllers (replicated row metadata) and warehouses (per-rank column stores);
gets move data peer to peer with one all-to-all. ``build_transfer_dock`` picks
the mode from ``rl_config.transfer_dock_mode``.
"""

from __future__ import annotations

import torch.distributed as dist

from mindspeed_rl.errors import TransferDockError, TransferDockTimeoutError
from mindspeed_rl.transfer_dock.assignment import assign_units, greedy_balance, token_spread
from mindspeed_rl.transfer_dock.centralized import CentralizedTransferDock
from mindspeed_rl.transfer_dock.controller import Controller
from mindspeed_rl.transfer_dock.dock import ConsumerLayout, DockBatch, DockMetrics, TransferDock
from mindspeed_rl.transfer_dock.warehouse import Warehouse

TRANSFER_DOCK_MODES = {"distributed": TransferDock, "centralized": CentralizedTransferDock}


def build_transfer_dock(mode: str = "distributed", group: dist.ProcessGroup | None = None,
                        **kwargs) -> TransferDock:
    """The dock for ``rl_config.transfer_dock_mode`` (``distributed`` or ``centralized``)."""
    try:
        cls = TRANSFER_DOCK_MODES[mode]
    except KeyError:
        raise ValueError(f"rl_config.transfer_dock_mode={mode!r} is not one of "
                         f"{sorted(TRANSFER_DOCK_MODES)}") from None
    return cls(group, **kwargs)


__all__ = [
    "CentralizedTransferDock", "ConsumerLayout", "Controller", "DockBatch", "DockMetrics",
    "TRANSFER_DOCK_MODES", "TransferDock", "TransferDockError", "TransferDockTimeoutError",
    "Warehouse", "assign_units", "build_transfer_dock", "greedy_balance", "token_spread",
]
