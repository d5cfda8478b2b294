"""Stream the actor's weights out of the training sharding, one bucket at a time.

Every rank walks the same plan (global parameter order) in lockstep. For each
parameter, the ranks of its pipeline stage all-gather its tensor-parallel shards
(expert shards over the expert-TP group, then across the expert-parallel group),
and the owning stage broadcasts the full tensor over the pipeline group. The
result is renamed to HF names by the architecture's weight map and handed to
the consumer (vLLM's in-place reload); a bucket of bounded bytes is gathered,
converted, consumed and freed before the next one starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from mindspeed_rl.resharding.ledger import ByteLedger

BUCKET = "bucket"


class ReshardingError(ValueError):
    """A resharding setting that cannot work; the message names the key."""


@dataclass(frozen=True)
class PlanItem:
    """One megatron parameter of the whole model and who holds it."""

    global_name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    pp_stage: int
    ep_rank: int | None  # None: not an expert parameter (held by every EP rank)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.full_shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class TrainingGroups:
    """The megatron process groups the stream collects over, passed explicitly
    (:meth:`from_megatron` reads them from megatron's parallel state)."""

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expert_tp: dist.ProcessGroup

    @classmethod
    def from_megatron(cls) -> "TrainingGroups":
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_group(),
                   pp=ps.get_pipeline_model_parallel_group(),
                   ep=ps.get_expert_model_parallel_group(),
                   expert_tp=ps.get_expert_tensor_parallel_group())


def _group_rank(group) -> int:
    return dist.get_rank(group)


class WeightStream:
    """Buckets of HF-named full tensors from a megatron model sharded TP x PP x EP.

    ``source(param)`` returns the tensor to read a local parameter from: the
    parameter itself, or its host copy while the training state is swapped out.
    """

    def __init__(self, model, weight_map, groups: TrainingGroups, bucket_bytes: int,
                 ledger: ByteLedger, device: torch.device,
                 source: Callable[[torch.Tensor], torch.Tensor] = lambda p: p) -> None:
        from mindspeed_rl.models.builder import global_parameter_names, global_weight_buffer_names

        if bucket_bytes <= 0:
            raise ReshardingError(
                f"generate_config.resharding_bucket_mb must be > 0 (got {bucket_bytes / 2**20:g} MB)")
        self.model, self.weight_map, self.groups = model, weight_map, groups
        self.bucket_bytes, self.ledger, self.device, self.source = bucket_bytes, ledger, device, source
        names = global_parameter_names(model)
        self.local = {g: model.get_parameter(n) for n, g in names.items()}
        # Weight buffers (DeepSeek-V3's router expert bias, updated by megatron outside the
        # optimizer) go to vLLM with the parameters.
        self.local.update({g: model.get_buffer(n) for n, g in global_weight_buffer_names(model).items()})
        # LoRA: the backbone weight of each adapted linear -> its module; the stream sends
        # W + (alpha / r) B A, the backbone itself stays unmerged for training.
        from mindspeed_rl.models.lora import adapted_modules

        self.adapters = {names[f"{n}.weight"]: m for n, m in adapted_modules(model).items()}
        self.pp_stage = _group_rank(groups.pp)
        self.ep_rank = _group_rank(groups.ep)
        self.plan = self._make_plan()
        self.buckets = self._make_buckets()
        self.bytes_received = 0

    # ---- plan (once) -----------------------------------------------------------------
    def _make_plan(self) -> list[PlanItem]:
        wm = self.weight_map
        tp_size = dist.get_world_size(self.groups.tp)
        etp_size = dist.get_world_size(self.groups.expert_tp)
        mine = {}
        for name, p in self.local.items():
            expert = wm.is_expert(name)
            shape = list(p.shape)
            dim = wm.tp_dim(name)
            if dim is not None:
                shape[dim] *= etp_size if expert else tp_size
            mine[name] = (tuple(shape), str(p.dtype).removeprefix("torch."), self.pp_stage,
                          self.ep_rank if expert else None)
        everyone: list[dict] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {}
        for d in everyone:
            merged.update(d)
        missing = [n for n in wm.megatron_names() if n not in merged]
        if missing:
            raise ReshardingError(f"no rank holds {missing[:3]}; the model and its weight map disagree")
        return [PlanItem(n, merged[n][0], getattr(torch, merged[n][1]), merged[n][2], merged[n][3])
                for n in wm.megatron_names()]

    def _make_buckets(self) -> list[list[PlanItem]]:
        """Consecutive items whose gathered bytes plus one item's conversion copy fit a bucket."""
        buckets, current, size, largest = [], [], 0, 0
        for item in self.plan:
            grown_largest = max(largest, item.nbytes)
            if current and size + item.nbytes + grown_largest > self.bucket_bytes:
                buckets.append(current)
                current, size, grown_largest = [], 0, item.nbytes
            current.append(item)
            size += item.nbytes
            largest = grown_largest
        if current:
            buckets.append(current)
        return buckets

    @property
    def model_bytes(self) -> int:
        return sum(i.nbytes for i in self.plan)

    # ---- collection ------------------------------------------------------------------
    def _gather_item(self, item: PlanItem) -> torch.Tensor:
        """The full tensor of ``item`` on every rank (collectives in plan order)."""
        wm, g = self.weight_map, self.groups
        full = None
        if item.pp_stage == self.pp_stage:
            holds = item.ep_rank is None or item.ep_rank == self.ep_rank
            if holds:
                local = self._local_shard(item.global_name)
                tp_group = g.expert_tp if item.ep_rank is not None else g.tp
                tp_size = dist.get_world_size(tp_group)
                if wm.tp_dim(item.global_name) is not None and tp_size > 1:
                    shards = [torch.empty_like(local) for _ in range(tp_size)]
                    dist.all_gather(shards, local.contiguous(), group=tp_group)
                    self.bytes_received += local.nbytes * (tp_size - 1)
                    full = wm.gather_tp(item.global_name, shards)
                else:  # read only (broadcast to the other stages, copied by vLLM)
                    full = local
            if item.ep_rank is not None and dist.get_world_size(g.ep) > 1:
                if full is None:
                    full = torch.empty(item.full_shape, dtype=item.dtype, device=self.device)
                    self.bytes_received += full.nbytes
                src = dist.get_global_rank(g.ep, item.ep_rank)
                dist.broadcast(full, src=src, group=g.ep)
        if dist.get_world_size(g.pp) > 1:
            if full is None:
                full = torch.empty(item.full_shape, dtype=item.dtype, device=self.device)
                self.bytes_received += full.nbytes
            dist.broadcast(full, src=dist.get_global_rank(g.pp, item.pp_stage), group=g.pp)
        return full

    def _local_shard(self, name: str) -> torch.Tensor:
        """This rank's shard of ``name`` as vLLM must see it: with a LoRA adapter, the merged
        ``W_k + (alpha / r) (B A)_k``, exactly the shard of the merged full weight."""
        local = self.source(self.local[name]).to(self.device)
        module = self.adapters.get(name)
        if module is None:
            return local
        delta = module.delta_weight(lambda p: self.source(p).to(self.device))
        return (local.float() + delta).to(local.dtype)

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) for the whole model, one bucket resident at a time."""
        for bucket in self.buckets:
            gathered = []
            for item in bucket:
                gathered.append((item, self._gather_item(item)))
                self.ledger.alloc(BUCKET, item.nbytes)
            while gathered:
                item, full = gathered.pop(0)
                # views of the gathered tensor where the layouts allow: vLLM's loaders copy
                # them into its own weights (a layer's tensors are held until it is whole)
                hf = self.weight_map.to_hf(item.global_name, full, copy=False)
                hf_bytes = sum(t.nbytes for _, t in hf)
                self.ledger.alloc(BUCKET, hf_bytes)
                del full
                self.ledger.free(BUCKET, item.nbytes)
                yield from hf
                del hf
                self.ledger.free(BUCKET, hf_bytes)

    def full_model(self) -> list[tuple[str, torch.Tensor]]:
        """The naive baseline: every HF tensor of the model gathered at once."""
        out = []
        for item in self.plan:
            full = self._gather_item(item)
            self.ledger.alloc("full_model", item.nbytes)
            out.extend(self.weight_map.to_hf(item.global_name, full))
        return out
