"""Metrics: per-iteration scalars to JSONL/TensorBoard/wandb/console, phase timers, progress bars.

See docs/metrics.md for the metric keys, the files written and how to plot them
(``tools/plot_metrics.py``).
"""

from mindspeed_rl.metrics.logger import MetricsLogger, format_console_line, read_metrics
from mindspeed_rl.metrics.progress import rank0_progress
from mindspeed_rl.metrics.timers import Timers

__all__ = ["MetricsLogger", "Timers", "format_console_line", "rank0_progress", "read_metrics"]
