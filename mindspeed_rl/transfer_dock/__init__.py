"""TransferDock: the sample flow of the RL iteration (docs/transfer_dock.md).

Controllers (replicated row metadata) and warehouses (per-rank column stores);
gets move data peer to peer with one all-to-all. A mode is a subclass of
:class:`TransferDock` that says where cells live (``distributed.py``,
``centralized.py``); ``build_transfer_dock`` picks it from
``rl_config.transfer_dock_mode``.
"""

from __future__ import annotations

import torch.distributed as dist

from mindspeed_rl.errors import TransferDockError, TransferDockTimeoutError
from mindspeed_rl.transfer_dock.assignment import assign_units, greedy_balance, token_spread
from mindspeed_rl.transfer_dock.batch import DockBatch, DockMetrics
from mindspeed_rl.transfer_dock.centralized import CentralizedTransferDock
from mindspeed_rl.transfer_dock.controller import Controller
from mindspeed_rl.transfer_dock.distributed import DistributedTransferDock
from mindspeed_rl.transfer_dock.dock import TransferDock
from mindspeed_rl.transfer_dock.consumer_layout import ConsumerLayout
from mindspeed_rl.transfer_dock.warehouse import Warehouse

TRANSFER_DOCK_MODES = {"distributed": DistributedTransferDock,
                       "centralized": CentralizedTransferDock}


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
    "CentralizedTransferDock", "ConsumerLayout", "Controller", "DistributedTransferDock",
    "DockBatch", "DockMetrics", "TRANSFER_DOCK_MODES", "TransferDock", "TransferDockError",
    "TransferDockTimeoutError", "Warehouse", "assign_units", "build_transfer_dock",
    "greedy_balance", "token_spread",
]
