"""MoE routing replay in the training engine, through megatron-core's own ``RouterReplay``.

A model built with ``moe_enable_routing_replay`` gives each ``TopKRouter`` a
``RouterReplay`` (actions RECORD, REPLAY_FORWARD, REPLAY_BACKWARD). megatron-core keeps
every instance of the process in one class-level list (actor, reference, critic ... in
construction order), so :class:`RouterReplayer` drives only the routers of the model it is
given, found in that model's modules and ordered by layer number.

Per micro-batch (``engine/schedule.py`` calls it around each forward):

* ``record``: the routers choose freely; the experts they chose become each row's
  ``[T, L, k]`` routing (``algorithms/routing.py``), in the smallest integer dtype;
* ``replay``: each router takes the micro-batch's ``routing`` (``MicroBatch.routing``) as
  its top-k; megatron-core gathers the router's scores at those experts, so the router
  weights are recomputed and keep their gradient. Positions without a route (padding, a
  row's last token) get distinct experts (``distinct_experts``). Before the backward the
  action becomes REPLAY_BACKWARD (a recomputed forward pops the same routes); the
  backward lists are cleared at :meth:`finish`, every step.

Both modes observe the routing megatron actually dispatched (the routers' routing maps);
in replay mode :attr:`differing` counts, per MoE layer, the tokens whose experts differ
from the replayed ones (0 when replay holds).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from mindspeed_rl.algorithms.routing import distinct_experts, routing_dtype
from mindspeed_rl.parallel.groups import context_parallel
from mindspeed_rl.engine.micro_batches import MicroBatch

RECORD, REPLAY = "record", "replay"


class RouterReplayError(ValueError):
    """A model or layout where routes cannot be recorded or replayed; names the key."""


def model_routers(model) -> list:
    """The model's ``TopKRouter`` modules in layer order, each with its ``RouterReplay``."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = sorted((m for m in model.modules() if isinstance(m, TopKRouter)),
                     key=lambda r: r.layer_number or 0)
    config = model.config
    if not routers:
        raise RouterReplayError("rl_config.router_replay: the model has no MoE router to "
                                "replay; set router_replay: none for a dense model")
    if getattr(config, "moe_router_fusion", False):
        raise RouterReplayError("rl_config.router_replay: megatron-core's fused router "
                                "(moe_router_fusion) bypasses RouterReplay; build the model "
                                "without moe_router_fusion or set router_replay: none")
    if any(r.router_replay is None for r in routers):
        raise RouterReplayError("rl_config.router_replay: the model was built without "
                                "moe_enable_routing_replay (models/builder.py takes it from "
                                "rl_config.router_replay)")
    return routers


class RouterReplayer:
    """Record or replay the routing of one model, micro-batch by micro-batch."""

    def __init__(self, model, mode: str) -> None:
        if mode not in (RECORD, REPLAY):
            raise ValueError(f"mode must be {RECORD!r} or {REPLAY!r}, not {mode!r}")
        if context_parallel()[1] > 1:
            raise RouterReplayError("rl_config.router_replay with context parallelism: not "
                                    "supported; set actor_config.context_parallel_size: 1")
        self.routers = model_routers(model)
        self.mode, self.config = mode, model.config
        self.topk, self.num_experts = model.config.moe_router_topk, model.config.num_moe_experts
        self.rows: dict[int, torch.Tensor] = {}  # recorded: batch row -> [T, L, k]
        self.differing = torch.zeros(len(self.routers), dtype=torch.int64)
        self.compared = 0  # tokens compared (each in every layer)
        self._maps: list[torch.Tensor | None] = [None] * len(self.routers)
        self._hooks = [r.register_forward_hook(self._observe(k))
                       for k, r in enumerate(self.routers)]

    def _observe(self, k: int):
        def hook(_module, _args, output):
            self._maps[k] = output[1].detach()  # routing_map [local tokens, E] bool
        return hook

    # ---- around one micro-batch ---------------------------------------------------------
    def before_forward(self, mb: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        self._maps = [None] * len(self.routers)
        if self.mode == RECORD:
            for r in self.routers:
                r.router_replay.set_router_replay_action(A.RECORD)
            return
        if mb.routing is None and mb.num_real_rows:
            raise RouterReplayError("rl_config.router_replay: a micro-batch without the "
                                    "routed_experts column reached a replaying pass")
        b, S = mb.tokens.shape
        if mb.routing is None:  # no rows here (a rank with an empty share): padding only
            mb.routing = torch.full((b, S, len(self.routers), self.topk), -1, dtype=torch.long)
        routes = self._filled(mb.routing)  # [b, S, L, k]
        for k, r in enumerate(self.routers):
            target = self._local(routes[:, :, k].transpose(0, 1).contiguous())  # [S_loc, b, k]
            r.router_replay.set_target_indices(target.reshape(-1, self.topk))
            r.router_replay.set_router_replay_action(A.REPLAY_FORWARD)

    def after_forward(self, mb: MicroBatch) -> None:
        """Record the chosen experts per row (record), or count the tokens whose dispatched
        experts differ from the replayed ones (replay)."""
        b, S = mb.tokens.shape
        if self.mode == RECORD:
            chosen = torch.stack([self._gathered(r.router_replay.get_recorded_indices())
                                  .reshape(S, b, self.topk) for r in self.routers], dim=2)
            chosen = chosen.transpose(0, 1)  # [b, S, L, k]
            dtype = routing_dtype(self.num_experts)
            for row, j, start, t in _row_places(mb):
                self.rows[row] = chosen[j, start:start + t].to(dtype).clone()
            return
        if mb.routing.numel() == 0:  # no rows in this micro-batch: nothing to compare
            return
        known = mb.routing[:, :, 0, 0] >= 0
        expected = _one_hot(mb.routing.clamp(min=0), self.num_experts)  # [b, S, L, E]
        for k, used in enumerate(self._maps):
            if used is None:
                continue
            used = self._gathered(used).reshape(S, b, -1).transpose(0, 1)  # [b, S, E]
            wrong = (used != expected[:, :, k]).any(dim=-1) & known
            self.differing[k] += int(wrong.sum())
        self.compared += int(known.sum())

    def before_backward(self) -> None:
        """A recomputed forward in the backward replays the same routes."""
        if self.mode == REPLAY:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

            for r in self.routers:
                r.router_replay.set_router_replay_action(A.REPLAY_BACKWARD)

    def finish(self) -> None:
        """Leave the routers as they were: no action, no targets, empty backward lists."""
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- results ------------------------------------------------------------------------
    def recorded(self, num_rows: int) -> list[torch.Tensor]:
        """Each row's recorded ``[T, L, k]`` routing, in batch order."""
        missing = [i for i in range(num_rows) if i not in self.rows]
        if missing:
            raise RuntimeError(f"no routing was recorded for rows {missing[:5]}")
        return [self.rows[i] for i in range(num_rows)]

    # ---- layout helpers -------------------------------------------------------------------
    def _filled(self, routing: torch.Tensor) -> torch.Tensor:
        """``routing`` with distinct experts wherever it has none (-1)."""
        b, S = routing.shape[:2]
        filler = distinct_experts(b * S, self.topk, self.num_experts).reshape(b, S, 1, self.topk)
        filler = filler.expand(b, S, len(self.routers), self.topk)
        if routing.numel() == 0:
            return filler.contiguous()
        if routing.shape[2:] != filler.shape[2:]:
            raise RouterReplayError(
                f"rl_config.router_replay: the routed_experts column has {routing.shape[2]} "
                f"layers x top-{routing.shape[3]}, the model {len(self.routers)} MoE layers x "
                f"top-{self.topk}")
        return torch.where(routing >= 0, routing, filler)

    def _sp(self) -> tuple[int, int, object]:
        """(TP size, TP rank, TP group) when sequence parallelism splits the tokens."""
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        if not self.config.sequence_parallel or tp == 1:
            return 1, 0, None
        return tp, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    def _local(self, seq_major: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``[S, ...]`` under sequence parallelism."""
        tp, rank, _ = self._sp()
        return seq_major.chunk(tp, dim=0)[rank] if tp > 1 else seq_major

    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """``[S_local * b, X]`` of every TP rank, s-major (inverse of :meth:`_local`)."""
        tp, _, group = self._sp()
        if tp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)


@contextmanager
def replaying(model, mode: str | None) -> Iterator[RouterReplayer | None]:
    """A `RouterReplayer` of ``model`` in ``mode`` (RECORD or REPLAY) for the ``with`` block,
    its routers left clean afterwards (:meth:`RouterReplayer.finish`); None for no mode."""
    if mode is None:
        yield None
        return
    replayer = RouterReplayer(model, mode)
    try:
        yield replayer
    finally:
        replayer.finish()


def _one_hot(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[..., k]`` expert ids -> ``[..., E]`` bool map."""
    out = torch.zeros(routes.shape[:-1] + (num_experts,), dtype=torch.bool)
    return out.scatter(-1, routes, True)


def _row_places(mb: MicroBatch):
    """``(batch row, sequence, start, T)`` for each row of ``mb``: where its routed tokens
    (prompt + response - 1) sit in the ``[b, S]`` layout."""
    offsets = [0]
    for length in (mb.segments or [])[:-1]:
        offsets.append(offsets[-1] + length)
    for k, (row, (p, r)) in enumerate(zip(mb.rows, mb.row_lengths)):
        j = 0 if mb.segments is not None else k
        start = offsets[k] if mb.segments is not None else 0
        yield row, j, start, p + r - 1


def routing_metrics(replayer: RouterReplayer) -> dict[str, float]:
    """Over every DP rank: the fraction of (token, MoE layer) routings that differ from the
    replayed ones (``routing/diff_fraction``), and that fraction in the worst layer."""
    from mindspeed_rl.engine.schedule import reduce_sums_once_per_dp_rank

    keys = ["compared", *(f"layer{k}" for k in range(len(replayer.routers)))]
    sums = {"compared": float(replayer.compared),
            **{f"layer{k}": float(v) for k, v in enumerate(replayer.differing.tolist())}}
    totals = reduce_sums_once_per_dp_rank(sums, keys)
    compared = max(totals.pop("compared"), 1.0)
    per_layer = [v / compared for v in totals.values()]
    return {"routing/diff_fraction": sum(per_layer) / len(per_layer),
            "routing/diff_fraction_max_layer": max(per_layer)}
