"""Megatron's training process groups, created from a ParallelLayout."""

from __future__ import annotations

import torch.distributed as dist

from mindspeed_rl.parallel.layout import LayoutError, ParallelLayout


def initialize_megatron_parallel(layout: ParallelLayout, seed: int = 1234) -> None:
    """Create megatron-core's TP/PP/DP/EP groups and seed its model-parallel RNG tracker.

    torch.distributed must already be initialised with ``layout.world_size`` ranks, and
    ``setup_platform()`` must have run (megatron's RNG tracker needs the device adaptor).
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
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_megatron_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
