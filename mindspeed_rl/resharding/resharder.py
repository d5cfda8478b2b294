"""The resharding flow: the actor's weights between the training and the generation sharding.

``allgather_swap`` (docs/resharding.md), train -> generation:
  1. swap the optimizer state and grads to host (not needed for generation);
  2. swap the training params to host; the weight stream reads their host copies,
     so no device holds a second copy of the training shard;
  3. wake the generation weights and stream the model into them bucket by bucket
     (TP all-gather, EP gather, PP broadcast, HF renaming, vLLM in-place reload);
  4. wake the KV cache.
generation -> train: release the engine (weights + KV cache where the backend can),
then swap the training state back in place.

``naive`` is the baseline the paper improves on: every rank gathers the whole model
while the training state is still resident, then loads it.
"""

from __future__ import annotations

import os
import re
import time
from typing import Sequence

import torch

from mindspeed_rl.resharding.floor import Bandwidths, measure_bandwidths
from mindspeed_rl.resharding.ledger import ByteLedger, TransitionReport
from mindspeed_rl.resharding.swap import (TRAIN_GRAD, TRAIN_OPTIMIZER, TRAIN_PARAM, StateSwapper,
                                          training_state_tensors)
from mindspeed_rl.resharding.weight_stream import ReshardingError, TrainingGroups, WeightStream

GEN_WEIGHTS = "gen_weights"
MODES = ("allgather_swap", "naive")


# Fault injection (tests, drills): HF tensors whose names match this regex are not pushed to
# vLLM, so generation runs on stale weights; rollout/logprob_abs_diff_* must show it.
STALE_WEIGHTS_ENV = "MINDSPEED_RL_INJECT_STALE_WEIGHTS"


def _without_injected_stale(tensors):
    pattern = os.environ.get(STALE_WEIGHTS_ENV)
    if not pattern:
        return tensors
    regex = re.compile(pattern)
    return ((name, t) for name, t in tensors if not regex.search(name))


class Resharder:
    """Toggles one actor between megatron (training) and vLLM (generation) on this rank."""

    def __init__(self, *, model, model_chunks: Sequence, optimizer, engine, weight_map,
                 bucket_bytes: int, platform, mode: str = "allgather_swap",
                 offload_train_param: bool = True, offload_train_grad: bool = True,
                 offload_train_optimizer: bool = True, groups: TrainingGroups | None = None,
                 bandwidths: Bandwidths | None = None) -> None:
        if mode not in MODES:
            raise ReshardingError(f"resharding mode {mode!r} is not one of {MODES}")
        self.mode, self.engine, self.platform = mode, engine, platform
        self.model_chunks, self.optimizer = list(model_chunks), optimizer
        self.offload_roles = [role for role, on in ((TRAIN_GRAD, offload_train_grad),
                                                    (TRAIN_OPTIMIZER, offload_train_optimizer),
                                                    (TRAIN_PARAM, offload_train_param)) if on]
        self.ledger = ByteLedger()
        self.swapper = StateSwapper(self.ledger, pin_memory=platform.device_type != "cpu")
        self.stream = WeightStream(
            model, weight_map, groups or TrainingGroups.from_megatron(), bucket_bytes, self.ledger,
            platform.device(), source=self.swapper.host_view)
        # no engine: a job that never generates (DPO without evaluation) keeps the ledger
        self.gen_weight_bytes = engine.weight_bytes() if engine is not None else 0
        self.in_generation = False
        # what each transition's bytes would take at this rank's bandwidths (floor.py)
        self.bandwidths = bandwidths or measure_bandwidths(platform.device())

    # ---- helpers ---------------------------------------------------------------------
    def _begin(self, direction: str) -> tuple[TransitionReport, float, tuple[int, int]]:
        self.platform.synchronize()
        self.platform.reset_peak_memory_stats()
        self.ledger.reset_peak()
        report = TransitionReport(direction, resident_bytes_before=self.ledger.resident)
        return report, time.perf_counter(), (self.stream.bytes_received, self.swapper.bytes_moved)

    def _end(self, report: TransitionReport, start: float, before: tuple[int, int],
             written: int = 0) -> TransitionReport:
        self.platform.synchronize()
        report.seconds = time.perf_counter() - start
        report.bytes_received = self.stream.bytes_received - before[0]
        swapped = self.swapper.bytes_moved - before[1]
        report.bytes_moved = report.bytes_received + swapped
        report.bytes_written = written
        report.floor_s = self.bandwidths.floor_s(received=report.bytes_received,
                                                 swapped=swapped, written=written)
        report.peak_bytes = self.ledger.peak
        report.resident_bytes_after = self.ledger.resident
        report.device_max_memory_allocated = self.platform.max_memory_allocated()
        return report

    @property
    def training_shard_bytes(self) -> int:
        """Params + grads + optimizer state of this rank (as last collected)."""
        return sum(self.swapper.nbytes(r) for r in (TRAIN_PARAM, TRAIN_GRAD, TRAIN_OPTIMIZER))

    # ---- transitions -----------------------------------------------------------------
    @torch.no_grad()
    def to_infer(self) -> TransitionReport:
        """Training sharding -> generation sharding (the engine holds the current weights)."""
        if self.in_generation:
            raise RuntimeError("to_infer() twice without to_train()")
        # Optimizer state appears lazily (first step): collect the storages every time.
        self.swapper.refresh(training_state_tensors(self.model_chunks, self.optimizer))
        report, start, moved = self._begin("to_infer")
        if self.mode == "naive":
            full = self.stream.full_model()
            self.engine.wake_up(["weights"])
            self.ledger.set(GEN_WEIGHTS, self.gen_weight_bytes)
            self.engine.load_weights(full)
            del full
            self.ledger.set("full_model", 0)
            self.swapper.offload(self.offload_roles)
        else:
            self.swapper.offload(self.offload_roles)
            self.engine.wake_up(["weights"])
            self.ledger.set(GEN_WEIGHTS, self.gen_weight_bytes)
            self.engine.load_weights(_without_injected_stale(self.stream.hf_tensors()))
        self.engine.wake_up(["kv_cache"])
        self.in_generation = True
        return self._end(report, start, moved, written=self.gen_weight_bytes)

    @torch.no_grad()
    def to_train(self) -> TransitionReport:
        """Generation sharding -> training sharding (training state back in place)."""
        if not self.in_generation:
            raise RuntimeError("to_train() without a preceding to_infer()")
        report, start, moved = self._begin("to_train")
        # Release the engine first so its memory is free before the training state returns.
        # vLLM-CPU cannot release (sleep is a no-op there); the ledger follows the protocol.
        self.engine.sleep()
        self.ledger.set(GEN_WEIGHTS, 0)
        self.swapper.onload([TRAIN_PARAM, TRAIN_GRAD, TRAIN_OPTIMIZER])
        self.in_generation = False
        return self._end(report, start, moved)
