"""Centralized mode: the classic single replay buffer on rank 0 (ablation baseline).

Same API and the same replicated control as :class:`TransferDock` — so both
modes deliver identical batches — but every cell lives on dock rank 0: a put
gathers the cells to rank 0, a get scatters them from rank 0. It uses the same
packed ``all_to_all_single`` transport, so the difference measured against the
distributed mode is the topology (everything through one rank, two hops per
cell), not the serialisation. Select it with ``rl_config.transfer_dock_mode:
centralized``.
"""

from __future__ import annotations

from mindspeed_rl.transfer_dock.dock import TransferDock


class CentralizedTransferDock(TransferDock):
    """TransferDock whose only warehouse is dock rank 0."""

    mode = "centralized"

    def _home(self, owner: int) -> int:
        """Every cell is stored on rank 0, whoever computed it."""
        return 0
