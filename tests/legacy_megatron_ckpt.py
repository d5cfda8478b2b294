"""Write a Megatron-LM legacy checkpoint (``--ckpt-format torch``) the way Megatron-LM does.

Each rank of a TP x PP layout saves ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` =
``torch.save({"args": argparse.Namespace, "checkpoint_version": 3.0, "iteration": N,
"model": model.state_dict_for_save_checkpoint(), "rng_state": [...], "optimizer": ...,
"opt_param_scheduler": ...})`` and rank 0 writes ``latest_checkpointed_iteration.txt``.
The model is a megatron-core GPTModel filled from a tiny HF directory, so the checkpoint
holds known weights. Test helper only.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


@contextlib.contextmanager
def _model_at_layout(hf_dir: str, tp: int, pp: int):
    """This rank's megatron GPTModel of ``hf_dir`` at TP x PP, its weights loaded; the
    process groups are torn down on exit."""
    from mindspeed_rl.models.builder import build_model_from_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel, initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    initialize_megatron_parallel(ParallelLayout(world_size=dist.get_world_size(),
                                                tensor_model_parallel_size=tp,
                                                pipeline_model_parallel_size=pp))
    try:
        model, arch, config = build_model_from_hf_dir(hf_dir)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        yield model, config
    finally:
        destroy_megatron_parallel()


def save_legacy_checkpoint(hf_dir: str, out_dir: str, tp: int, pp: int, iteration: int,
                           extra_args: dict | None = None) -> None:
    """Run on every rank of a TP x PP world (e.g. through run_on_ranks)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with _model_at_layout(hf_dir, tp, pp) as (model, config):
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        args = argparse.Namespace(
            num_layers=config.num_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp, params_dtype=torch.float32, iteration=iteration,
            consumed_train_samples=iteration * 8, tokenizer_type="PretrainedFromHF",
            data_path=["./dataset/data"], **(extra_args or {}))
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
               "rng_tracker_states": get_cuda_rng_tracker().get_states()}
        state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                 "model": model.state_dict_for_save_checkpoint(), "rng_state": [rng],
                 "optimizer": {"optimizer": {"state": {}, "param_groups": []}},
                 "opt_param_scheduler": {"num_steps": iteration * 8}}
        name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        folder = Path(out_dir) / f"iter_{iteration:07d}" / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, folder / "model_optim_rng.pt")
        dist.barrier()
        if dist.get_rank() == 0:
            (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def save_torch_dist_checkpoint(hf_dir: str, out_dir: str, tp: int, pp: int,
                               iteration: int) -> None:
    """Megatron-LM's ``--ckpt-format torch_dist``: dist_checkpointing.save of the model's
    sharded state dict plus args, iteration and version in common.pt; run on every rank."""
    from megatron.core import dist_checkpointing

    with _model_at_layout(hf_dir, tp, pp) as (model, config):
        folder = Path(out_dir) / f"iter_{iteration:07d}"
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        args = argparse.Namespace(num_layers=config.num_layers, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, ckpt_format="torch_dist")
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                                 "iteration": iteration, "checkpoint_version": 3.0}, str(folder))
        dist.barrier()
        if dist.get_rank() == 0:
            (Path(out_dir) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
