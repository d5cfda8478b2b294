"""How much of each phase's compute is useful: ``perf/padding_efficiency/<phase>`` and
``perf/mfu/<phase>``.

:func:`count_tokens` (called by ``schedule.run_schedule`` for every schedule it
runs) adds up, per process, the real tokens, the positions the model computed
(``b x S`` of every micro-batch) and the sums the FLOPs model needs
(``mindspeed_rl.metrics.flops``). :class:`PhaseEfficiency` turns what one phase
counted into metrics, summed over the training DP ranks:

* ``perf/padding_efficiency/<phase>``: real tokens / computed tokens;
* ``perf/model_tflops/<phase>``: model FLOPs of the real tokens (x3 for a training
  step);
* ``perf/mfu/<phase>``: those FLOPs / the phase's seconds / world size / the
  matmul peak measured on every rank at start-up (``perf/matmul_peak_gflops``);
* ``perf/compute_floor_s``: the iteration's counted model FLOPs over the peak of
  all ranks: the time it would take at the measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mindspeed_rl.metrics.flops import forward_flops, matmul_gflops


@dataclass
class _Counts:
    real: float = 0.0  # real prompt + response tokens
    computed: float = 0.0  # positions the model ran (b x S)
    tokens: float = 0.0  # FLOPs model sums, x3 for training steps: sum S_i
    causal_pairs: float = 0.0  # sum S_i (S_i + 1) / 2
    projected: float = 0.0  # sum R_i

    def as_list(self) -> list[float]:
        return [self.real, self.computed, self.tokens, self.causal_pairs, self.projected]


_COUNTS = _Counts()


def count_tokens(micro, training: bool) -> None:
    """Add one schedule's micro-batches to this process's counts."""
    passes = 3.0 if training else 1.0
    for mb in micro:
        _COUNTS.real += mb.real_tokens
        _COUNTS.computed += mb.computed_tokens
        for p, r in mb.row_lengths or []:
            s = p + r
            _COUNTS.tokens += passes * s
            _COUNTS.causal_pairs += passes * s * (s + 1) / 2
            _COUNTS.projected += passes * r


def take_counts() -> _Counts:
    """This process's counts since the last call (and reset them)."""
    global _COUNTS
    counts, _COUNTS = _COUNTS, _Counts()
    return counts


class PhaseEfficiency:
    """Per-phase efficiency metrics of the trainer (see the module docstring).

    Args:
        spec: the model's ``ModelSpec`` (the FLOPs model's sizes).
        counted: whether this rank speaks for its training DP rank (TP/PP peers
            count the same micro-batches).
        peak_gflops: the measured matmul peak of one rank (None: measure it now, on
            every rank at the same time, in ``dtype`` on ``device``, for ``peak_seconds``
            after two warm-up products; it is paid at every launch. Two ranks at once on a
            2-core CPU, one thread each: 146.6-156.5 GFLOPS in 0.25 s, 148.3-155.6 in 1 s).
    """

    def __init__(self, spec, *, counted: bool, dtype=None, device=None,
                 peak_gflops: float | None = None, peak_seconds: float = 0.25) -> None:
        self.spec, self.counted = spec, counted
        self.world = dist.get_world_size()
        if peak_gflops is None:
            dist.barrier()
            mine = torch.tensor([matmul_gflops(seconds=peak_seconds, dtype=dtype,
                                               device=device)], dtype=torch.float64)
            dist.all_reduce(mine)
            peak_gflops = mine.item() / self.world
        self.peak_gflops = peak_gflops
        self._flops = 0.0
        take_counts()

    def after_phase(self, name: str, seconds: float) -> dict[str, float]:
        """Metrics of the phase that just ran (all ranks call it; empty if it ran no
        micro-batches). One all-reduce when it did."""
        counts = take_counts()
        ran = torch.tensor([float(counts.computed > 0)])
        dist.all_reduce(ran, op=dist.ReduceOp.MAX)
        if not ran.item():
            return {}
        t = torch.tensor(counts.as_list() if self.counted else [0.0] * 5, dtype=torch.float64)
        dist.all_reduce(t)
        real, computed, tokens, pairs, projected = t.tolist()
        flops = forward_flops(self.spec, tokens=tokens, causal_pairs=pairs, projected=projected)
        self._flops += flops
        out = {f"perf/padding_efficiency/{name}": real / max(computed, 1.0),
               f"perf/model_tflops/{name}": flops / 1e12}
        if seconds > 0:
            out[f"perf/mfu/{name}"] = flops / seconds / self.world / (self.peak_gflops * 1e9)
        return out

    def iteration(self) -> dict[str, float]:
        """The iteration's compute floor (FLOPs of the counted phases at the peak)."""
        flops, self._flops = self._flops, 0.0
        return {"perf/compute_floor_s": flops / (self.peak_gflops * 1e9 * self.world),
                "perf/matmul_peak_gflops": self.peak_gflops}
