"""Megatron's training process groups, created from a ParallelLayout."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch.distributed as dist

from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout
from mindspeed_rl.parallel.ports import free_port


# The bound on every collective of the job (rl_config.collective_timeout_s), set by
# init_distributed; the groups created later (megatron's, the TransferDock's, vLLM's)
# read it here so that one key bounds every wait.
_collective_timeout_s: float = 1800.0
# While the job starts (init_distributed to end_startup): the start-up bound
# (rl_config.startup_timeout_s). Ranks reach start-up's collectives far apart: rank 0 alone
# prints the plan and probes the save folder, checkpoint loads and vLLM's engine build take
# what the file system and the CPU give each rank. None when not starting.
_startup_timeout_s: float | None = None
# Groups whose bound after start-up is their own (the TransferDock's), not the job's.
_own_bounds: dict[dist.ProcessGroup, float] = {}
STARTUP_MIN_S = 600.0  # the start-up bound when rl_config.startup_timeout_s is null


def collective_timeout_s() -> float:
    """Seconds any collective of this job may wait for a peer (``rl_config.collective_timeout_s``)."""
    return _collective_timeout_s


def startup_bound(collective_s: float, startup_s: float | None) -> float:
    """The start-up bound of a job: ``rl_config.startup_timeout_s``, null = the larger of
    ``collective_timeout_s`` and ``STARTUP_MIN_S``."""
    return float(startup_s) if startup_s is not None else max(float(collective_s), STARTUP_MIN_S)


def group_timeout_s(bound_s: float | None = None) -> float:
    """The timeout a process group made now gets, for a group whose waits are bounded by
    ``bound_s`` (default: the job's collective bound): during start-up at least the
    start-up bound (:func:`end_startup` lowers it to ``bound_s`` afterwards)."""
    bound = _collective_timeout_s if bound_s is None else float(bound_s)
    return bound if _startup_timeout_s is None else max(bound, _startup_timeout_s)


def new_group(ranks: list[int] | None, *, timeout_s: float, backend: str | None = None
              ) -> dist.ProcessGroup:
    """``dist.new_group`` for a group whose waits have their own bound ``timeout_s``
    (:func:`group_timeout_s` while the job starts; that bound again after start-up)."""
    group = dist.new_group(ranks, timeout=timedelta(seconds=group_timeout_s(timeout_s)),
                           backend=backend)
    if _startup_timeout_s is not None:
        _own_bounds[group] = float(timeout_s)
    return group


def end_startup() -> None:
    """Start-up is over (the trainer is built, its checkpoint loaded): the ranks meet (a
    barrier, still under the start-up bound, so that what comes next starts together),
    then every process group made so far waits its own bound (the job's collective bound,
    or the one it was made with by :func:`new_group`). torch sets it for gloo and NCCL;
    HCCL keeps ``HCCL_EXEC_TIMEOUT`` (:func:`communicator_env`). Every rank calls it."""
    global _startup_timeout_s
    if _startup_timeout_s is None:
        return
    dist.barrier()
    _startup_timeout_s = None
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        bound = _own_bounds.get(group, _collective_timeout_s)
        with warnings.catch_warnings():  # a backend torch cannot set (HCCL): its env bounds
            warnings.simplefilter("ignore")
            c10d._set_pg_timeout(timedelta(seconds=bound), group)
    _own_bounds.clear()


def init_distributed(platform, timeout_s: float = 1800, startup_timeout_s: float | None = None
                     ) -> None:
    """Start torch.distributed for a launcher or tool on ``platform``'s backend.

    Under torchrun the environment names rank and world; a plain ``python tool.py``
    runs as a world of one (on a free port, so two such runs do not collide).
    ``timeout_s`` bounds every collective of the world group and of the groups made
    later from :func:`collective_timeout_s` (megatron's, the TransferDock's, vLLM's): a
    rank that does not reach a collective in time makes the others raise instead of
    waiting forever. Until :func:`end_startup` the bound is the start-up one
    (:func:`startup_bound` of ``timeout_s`` and ``startup_timeout_s``).
    """
    global _collective_timeout_s, _startup_timeout_s
    _collective_timeout_s = float(timeout_s)
    _startup_timeout_s = startup_bound(timeout_s, startup_timeout_s)
    _own_bounds.clear()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    communicator_env(timeout_s, connect_s=_startup_timeout_s)  # read by HCCL at its start
    platform.set_device()
    # NCCL (and gloo) take their timeout from the process group: the start-up bound until
    # end_startup lowers it.
    dist.init_process_group(platform.process_group_backend,
                            timeout=timedelta(seconds=_startup_timeout_s))


# HCCL's accepted ranges (CANN): connect 120..7200 s, execution 0..17340 s.
_HCCL_LIMITS = {"HCCL_CONNECT_TIMEOUT": (120, 7200), "HCCL_EXEC_TIMEOUT": (1, 17340)}


def communicator_env(timeout_s: float, environ=None, connect_s: float | None = None
                     ) -> dict[str, str]:
    """Set HCCL's own timeouts, unless exported already; returns what was set: its
    execution bound from ``timeout_s`` (rl_config.collective_timeout_s), its connect bound
    (communicators are made during start-up) from ``connect_s`` (default ``timeout_s``).
    HCCL waits on the device, where the process group's timeout does not reach: without
    these it waits its defaults (connect 120 s, execution about 30 min) whatever the config
    says."""
    environ = os.environ if environ is None else environ
    wanted = {"HCCL_CONNECT_TIMEOUT": timeout_s if connect_s is None else connect_s,
              "HCCL_EXEC_TIMEOUT": timeout_s}
    derived = {name: str(min(max(int(wanted[name]), low), high))
               for name, (low, high) in _HCCL_LIMITS.items() if name not in environ}
    environ.update(derived)
    return derived


def initialize_megatron_parallel(layout: ParallelLayout, seed: int = 1234,
                                 timeout_s: float | None = None) -> None:
    """Create megatron-core's TP/CP/PP/DP/EP groups and seed its model-parallel RNG tracker.

    torch.distributed must already be initialised with ``layout.world_size`` ranks, and
    ``setup_platform()`` must have run (megatron's RNG tracker needs the device adaptor).
    The groups' timeout is ``timeout_s``, by default :func:`collective_timeout_s`
    (at least the start-up bound while the job starts: :func:`group_timeout_s`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed before initialize_megatron_parallel()")
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"the layout was made for world_size={layout.world_size} but torch.distributed "
            f"has {dist.get_world_size()} ranks; launch with --nproc_per_node x --nnodes = "
            f"{layout.world_size}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        # megatron builds timedelta(minutes=...), which takes fractions: seconds survive.
        distributed_timeout_minutes=group_timeout_s(timeout_s) / 60,
    )
    model_parallel_cuda_manual_seed(seed)


def context_parallel() -> tuple[int, int]:
    """(this rank's context-parallel rank, the context-parallel size). At run time the one
    source is megatron's parallel state, which :func:`initialize_megatron_parallel` built from
    the layout; every runtime reader (micro-batches, schedule, model build, checkpoints,
    metrics, the dock's consumer layout) asks here."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def teardown_distributed(close=None) -> None:
    """Release megatron's groups, then ``close()`` (e.g. the trainer: vLLM's engine teardown
    also destroys the default process group), then torch.distributed if still up."""
    destroy_megatron_parallel()
    if close is not None:
        close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _own_bounds.clear()
