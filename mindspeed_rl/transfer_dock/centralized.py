"""Centralized mode: the classic single replay buffer on rank 0 (ablation baseline).

Same API and the same replicated control as the distributed mode
(``distributed.py``) — so both modes deliver identical batches — but every cell
lives on dock rank 0: every put (results included) hands the cells to rank 0,
every get is served from rank 0, and consumers keep nothing. It uses the same
packed ``all_to_all_single`` transport, so the difference measured against the
distributed mode is the topology (everything through one rank, two hops per
cell), not the serialisation. Select it with ``rl_config.transfer_dock_mode:
centralized``.
"""

from __future__ import annotations

import numpy as np

from mindspeed_rl.transfer_dock.dock import TransferDock


class CentralizedTransferDock(TransferDock):
    """TransferDock whose only warehouse is dock rank 0."""

    mode = "centralized"

    def _placement(self, owners: np.ndarray, had_copy: np.ndarray, rank: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Every cell is stored on, and served from, rank 0, whoever computed it."""
        return np.zeros_like(owners), np.full(had_copy.shape, rank == 0)
