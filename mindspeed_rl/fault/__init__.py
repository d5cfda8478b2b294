"""Faults: a hung or dead rank, preemption, bad numbers — and how a launcher reports them.

- :mod:`~mindspeed_rl.fault.phase_tracker`: the phase and iteration of every rank, published in
  the job's store so a survivor names where a failed collective was and who is lost;
- :mod:`~mindspeed_rl.fault.collective`: recognising a failed collective, in one line;
- :mod:`~mindspeed_rl.fault.preemption`: SIGTERM -> checkpoint at the next iteration
  boundary, agreed by all ranks;
- :mod:`~mindspeed_rl.fault.nonfinite`: NaN/Inf loss or gradient -> the optimizer step is
  skipped on every rank;
- :mod:`~mindspeed_rl.fault.torchrun`: torchrun with a one-line failure summary;
- :mod:`~mindspeed_rl.fault.injection`: the test hook that hangs or kills a rank at a phase.

The launchers' one-line errors and exit statuses are mindspeed_rl/trainer/launch_guard.py
(it sorts the exceptions of every layer, so it sits on top, beside the launchers' bootstrap).
docs/reliability.md lists every fault and bad input with its message and its test.
"""
