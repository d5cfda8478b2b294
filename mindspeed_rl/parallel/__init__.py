"""Parallel layouts (training TP x PP x DP, generation TP_g x DP_g) and process groups."""

from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout

__all__ = ["LayoutError", "ParallelLayout"]
