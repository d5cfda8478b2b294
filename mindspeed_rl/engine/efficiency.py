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

:func:`count_generation` (called by the rollout for every generation pass, on the rank
that writes its vLLM instance's rows) adds up the FLOPs model's sums of what the engine
generated; the phase that generated then reports

* ``perf/model_tflops/<phase>`` and ``perf/mfu/<phase>`` as above;
* ``perf/rollout_floor_s``: those FLOPs over the peak of all ranks (prefill once per
  distinct context, as vLLM's prefix cache and the samples of one prompt share it; every
  new token one forward position over its context, through the output layer). It is not
  part of ``perf/compute_floor_s``, which counts the training side only.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
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
_GENERATED = _Counts()


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


def count_generation(rows: Iterable[tuple[Hashable, int, int]]) -> None:
    """Add one generation pass of this process's engine: per row, the key of its context
    (rows with equal keys share one prefill), the context's length and the new tokens."""
    prefilled = set()
    for key, context, new in rows:
        if key not in prefilled:
            prefilled.add(key)
            _GENERATED.tokens += context
            _GENERATED.causal_pairs += context * (context + 1) / 2
        _GENERATED.tokens += new
        _GENERATED.causal_pairs += new * context + new * (new + 1) / 2
        _GENERATED.projected += new


def take_counts() -> _Counts:
    """This process's forward counts since the last call (and reset them)."""
    global _COUNTS
    counts, _COUNTS = _COUNTS, _Counts()
    return counts


def take_generated() -> _Counts:
    """This process's generation counts since the last call (and reset them)."""
    global _GENERATED
    generated, _GENERATED = _GENERATED, _Counts()
    return generated


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
        take_counts(), take_generated()

    def after_phase(self, name: str, seconds: float) -> dict[str, float]:
        """Metrics of the phase that just ran (all ranks call it; empty if it ran no
        micro-batches and generated nothing). One all-reduce when it did."""
        counts, generated = take_counts(), take_generated()
        ran = torch.tensor([float(counts.computed > 0 or generated.tokens > 0)])
        dist.all_reduce(ran, op=dist.ReduceOp.MAX)
        if not ran.item():
            return {}
        # generation counts come from the instances' writers only (count_generation)
        t = torch.tensor((counts.as_list() if self.counted else [0.0] * 5)
                         + generated.as_list()[2:], dtype=torch.float64)
        dist.all_reduce(t)
        real, computed, tokens, pairs, projected, g_tokens, g_pairs, g_projected = t.tolist()
        peak = self.peak_gflops * 1e9 * self.world
        out, flops = {}, 0.0
        if computed > 0:
            flops = forward_flops(self.spec, tokens=tokens, causal_pairs=pairs,
                                  projected=projected)
            self._flops += flops
            out[f"perf/padding_efficiency/{name}"] = real / computed
        if g_tokens > 0:
            generated_flops = forward_flops(self.spec, tokens=g_tokens, causal_pairs=g_pairs,
                                            projected=g_projected)
            out["perf/rollout_floor_s"] = generated_flops / peak
            flops += generated_flops
        out[f"perf/model_tflops/{name}"] = flops / 1e12
        if seconds > 0:
            out[f"perf/mfu/{name}"] = flops / seconds / peak
        return out

    def iteration(self) -> dict[str, float]:
        """The iteration's compute floor (FLOPs of the counted phases at the peak)."""
        flops, self._flops = self._flops, 0.0
        return {"perf/compute_floor_s": flops / (self.peak_gflops * 1e9 * self.world),
                "perf/matmul_peak_gflops": self.peak_gflops}
