"""Megatron's training process groups, created from a ParallelLayout."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout
from mindspeed_rl.parallel.ports import free_port


# The bound on every collective of the job (rl_config.collective_timeout_s), set by
# init_distributed; the groups created later (megatron's, the TransferDock's, vLLM's)
# read it here so that one key bounds every wait.
_collective_timeout_s: float = 1800.0


def collective_timeout_s() -> float:
    """Seconds any collective of this job may wait for a peer (``rl_config.collective_timeout_s``)."""
    return _collective_timeout_s


def init_distributed(platform, timeout_s: float = 1800) -> None:
    """Start torch.distributed for a launcher or tool on ``platform``'s backend.

    Under torchrun the environment names rank and world; a plain ``python tool.py``
    runs as a world of one (on a free port, so two such runs do not collide).
    ``timeout_s`` bounds every collective of the world group and of the groups made
    later from :func:`collective_timeout_s` (megatron's, the TransferDock's, vLLM's): a
    rank that does not reach a collective in time makes the others raise instead of
    waiting forever.
    """
    global _collective_timeout_s
    _collective_timeout_s = float(timeout_s)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    communicator_env(timeout_s)  # read by HCCL when its communicators start
    platform.set_device()
    # NCCL (and gloo) take their timeout from the process group: the same bound.
    dist.init_process_group(platform.process_group_backend, timeout=timedelta(seconds=timeout_s))


# HCCL's accepted ranges (CANN): connect 120..7200 s, execution 0..17340 s.
_HCCL_LIMITS = {"HCCL_CONNECT_TIMEOUT": (120, 7200), "HCCL_EXEC_TIMEOUT": (1, 17340)}


def communicator_env(timeout_s: float, environ=None) -> dict[str, str]:
    """Set HCCL's own timeouts from ``timeout_s`` (rl_config.collective_timeout_s), unless
    exported already; returns what was set. HCCL waits on the device, where the process
    group's timeout does not reach: without these it waits its defaults (connect 120 s,
    execution about 30 min) whatever the config says."""
    environ = os.environ if environ is None else environ
    derived = {name: str(min(max(int(timeout_s), low), high))
               for name, (low, high) in _HCCL_LIMITS.items() if name not in environ}
    environ.update(derived)
    return derived


def initialize_megatron_parallel(layout: ParallelLayout, seed: int = 1234,
                                 timeout_s: float | None = None) -> None:
    """Create megatron-core's TP/CP/PP/DP/EP groups and seed its model-parallel RNG tracker.

    torch.distributed must already be initialised with ``layout.world_size`` ranks, and
    ``setup_platform()`` must have run (megatron's RNG tracker needs the device adaptor).
    The groups' timeout is ``timeout_s``, by default :func:`collective_timeout_s`.
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
        distributed_timeout_minutes=(timeout_s or _collective_timeout_s) / 60,
    )
    model_parallel_cuda_manual_seed(seed)


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
