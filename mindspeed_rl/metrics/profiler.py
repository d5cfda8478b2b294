"""torch.profiler around chosen phases of chosen iterations (``profiler_config.integrated``).

A :class:`PhaseProfiler` is a phase observer (:func:`mindspeed_rl.metrics.timers.
add_phase_observer`): it starts ``torch.profiler.profile`` when a profiled phase of a
profiled iteration begins and writes the trace when that phase ends (the timers synchronize
the device first, so its kernels are in). ``targets`` maps each profiled phase to the folder
its traces go to; None profiles whole iterations (the trainer's ``all`` phase) from
``profile_step_start`` to the end of ``profile_step_end - 1``, in one trace.

While recording, every phase the iteration enters is a labelled range (``phase/<name>``,
and ``iteration/<k>`` around a whole iteration) in the trace; with ``mstx`` every phase of every iteration is also an NVTX range when CUDA
is present (what Nsight Systems shows; MindSpeed-RL's mstx ranges on Ascend).

Iterations are counted from 1 at this launch's first, as MindSpeed-RL counts them.
Traces are Chrome trace JSON (chrome://tracing, Perfetto, TensorBoard's profiler plugin),
written under a temporary name and renamed, so a file that exists is whole.
"""

from __future__ import annotations

import os

import torch

ITERATION = "all"  # the trainer's phase around one whole iteration
WHOLE_ITERATIONS = "integrated"  # the folder of whole-iteration traces (MindSpeed-RL's role)


class PhaseProfiler:
    """Records the ``targets`` phases (None: whole iterations) of the iterations in
    ``[settings.profile_step_start, settings.profile_step_end)`` on this rank into
    ``folder``. ``settings``: a ``ProfilerSettings`` (``mindspeed_rl/config/schema.py``)."""

    def __init__(self, settings, *, targets: dict[str, str] | None, rank: int,
                 folder: str) -> None:
        self.settings, self.targets, self.rank, self.folder = settings, targets, rank, folder
        self.finished = 0          # iterations of this launch that ended
        self.written: list[str] = []
        self._prof: torch.profiler.profile | None = None
        self._phase: str | None = None   # the target being recorded
        self._first = 0                  # the iteration its recording started in
        self._inside = False             # within an iteration (between enter and exit of all)
        self._ranges: dict[str, torch.profiler.record_function] = {}
        self._nvtx = settings.mstx and torch.cuda.is_available()

    def observe(self, name: str, event: str) -> None:
        """The phase observer: ``event`` is "enter", "exit" or "fail"."""
        if event == "enter":
            self._inside = self._inside or name == ITERATION
            if self._nvtx:
                torch.cuda.nvtx.range_push(name)
            if self._prof is None and self._records(name):
                self._start(name)
            if self._prof is not None:
                label = (f"iteration/{self.finished + 1}" if name == ITERATION
                         else f"phase/{name}")
                self._ranges[name] = torch.profiler.record_function(label)
                self._ranges[name].__enter__()
            return
        if name in self._ranges:
            self._ranges.pop(name).__exit__(None, None, None)
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        if self._prof is not None and name == self._phase and (
                self.targets is not None or event == "fail"
                or self.finished + 1 >= self.settings.profile_step_end - 1):
            self._stop()
        if name == ITERATION:
            self.finished += 1
            self._inside = False

    def close(self) -> None:
        """Write what is being recorded (a run that ended inside the profiled range)."""
        if self._prof is not None:
            self._stop()

    # ---- the recording -------------------------------------------------------------------
    def _records(self, name: str) -> bool:
        s, iteration = self.settings, self.finished + 1
        if not s.profile_step_start <= iteration < s.profile_step_end:
            return False
        return name == ITERATION if self.targets is None else name in self.targets

    def _start(self, name: str) -> None:
        s = self.settings
        activities = []
        if s.profile_with_cpu:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if s.profile_with_npu and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if not activities:  # nothing asked that this machine has: the host side
            activities.append(torch.profiler.ProfilerActivity.CPU)
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=s.profile_record_shapes,
            profile_memory=s.profile_with_memory, with_stack=s.profile_with_module)
        self._prof.__enter__()
        self._phase = name
        self._first = self.finished + 1

    def _stop(self) -> None:
        prof, name = self._prof, self._phase
        self._prof = self._phase = None
        for label in list(self._ranges):
            self._ranges.pop(label).__exit__(None, None, None)
        prof.__exit__(None, None, None)
        last = self.finished + 1 if self._inside else self.finished
        sub = WHOLE_ITERATIONS if self.targets is None else self.targets[name]
        span = f"iter{self._first}" + (f"-{last}" if last != self._first else "")
        stem = os.path.join(self.folder, sub, f"rank{self.rank}_{span}")
        k = 1
        while os.path.exists(f"{stem}{'' if k == 1 else f'_{k}'}.pt.trace.json"):
            k += 1  # a phase entered again in one iteration (generation rounds)
        stem += "" if k == 1 else f"_{k}"
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        _write(f"{stem}.pt.trace.json", prof.export_chrome_trace)
        self.written.append(f"{stem}.pt.trace.json")
        if self.settings.profile_analysis:
            device = any(e.device_type == torch.autograd.DeviceType.CUDA
                         for e in prof.key_averages())
            table = prof.key_averages().table(
                sort_by="self_cuda_time_total" if device else "self_cpu_time_total",
                row_limit=40)
            _write(f"{stem}.txt", lambda path: _write_text(path, table + "\n"))


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write(path: str, export) -> None:
    """``export(tmp)`` then rename: a file at ``path`` is always whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        export(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
