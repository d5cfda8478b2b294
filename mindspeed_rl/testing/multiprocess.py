"""Run a function on N local ranks joined by a gloo process group.

Used by the multi-process tests: the test body is a module-level function; it
runs in N fresh processes with torch.distributed already initialised from a
FileStore (no fixed ports), and its return values come back to the caller in
rank order. A failure on any rank, a rank that dies, or a run past `timeout`
stops every rank and raises with the failing rank's traceback, so a broken
collective never hangs the test session.

Ranks are forked from one forkserver per test session that has imported torch,
megatron-core, transformers and vLLM's engine once (``PRELOAD``): a rank starts in well
under a second instead of the 8-10 s a spawned interpreter spends importing them. Each rank
is still a new process with no state of any earlier test (the server itself never
runs a tensor op, builds a group or initialises megatron).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

from mindspeed_rl.parallel.ports import free_port


# Imported once by the forkserver; each rank forks from it. Importing a module runs no
# kernel, so no OpenMP pool exists before the fork (libgomp does not survive one).
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "transformers", "safetensors.torch",
           # vLLM's LLM class, not its model runner or sampler: those are imported when an
           # engine is built, after rollout/vllm_engine.py has set their compile backend.
           "vllm.entrypoints.llm", "mindspeed_rl.testing.multiprocess"]


def _context() -> "mp.context.BaseContext":
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first rank)
    return ctx


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


def _worker(rank: int, world_size: int, store_path: str, port: int, fn: Callable,
            args: tuple, kwargs: dict, env: dict[str, str], results: "mp.Queue") -> None:
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    import torch
    import torch.distributed as dist

    # Share the machine's cores between ranks instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}",
                                rank=rank, world_size=world_size)
        value = fn(*args, **kwargs)
        # Plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600,
                 env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = _context()
    results = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="msrl_ranks_")
    store_path = os.path.join(tmpdir, "store")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, name=f"rank{r}", daemon=False,
                    args=(r, world_size, store_path, port, fn, args, kwargs, env or {}, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    by_rank: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(by_rank) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailure(
                        f"{dead[0].name} of {world_size} exited with code {dead[0].exitcode} "
                        f"before reporting a result (crash or kill in {fn.__name__})"
                    )
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(by_rank))
                    raise RankFailure(
                        f"{fn.__name__} on {world_size} ranks timed out after {timeout:.0f}s; "
                        f"ranks still running: {missing}"
                    )
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{value}")
            by_rank[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [by_rank[r] for r in range(world_size)]
    finally:
        # A rank stopped early skips its exit handlers, so helpers it started (megatron's
        # checkpoint writer starts a multiprocessing manager) would outlive it, holding the
        # test session's stdout open: they are stopped with it.
        helpers = [c for p in procs if p.is_alive() for c in _descendants(p.pid)]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for helper in helpers:
            with contextlib.suppress(Exception):
                helper.kill()
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _descendants(pid: int) -> list:
    """The live processes ``pid`` started, and theirs (psutil handles)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
