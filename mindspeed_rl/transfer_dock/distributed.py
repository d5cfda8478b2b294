"""Distributed mode (the default): every rank is a warehouse of what it computed or received.

A cell stays on every rank that computed it (TP/PP peers that computed the same
cell each keep their copy) and on every rank a get delivered it to, until it is
retired; its owner, one of the ranks that computed it, serves it to ranks lacking
it. So a put moves nothing (a put of results needs no collective at all), and a
get moves each cell once per consumer rank that lacks it, peer to peer.
"""

from __future__ import annotations

import numpy as np

from mindspeed_rl.transfer_dock.dock import TransferDock


class DistributedTransferDock(TransferDock):
    """TransferDock whose cells live where they were computed or delivered."""

    mode = "distributed"

    def _placement(self, owners: np.ndarray, had_copy: np.ndarray, rank: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """A cell is served by its owner and held by every rank that had a copy."""
        return owners, had_copy
