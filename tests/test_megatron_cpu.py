"""megatron-core features on CPU behind the platform adaptor (gloo, spawned ranks).

Every test compares numbers: a layout-invariant quantity (loss, global grad norm,
logits) across TP / PP / SP / DP / distributed-optimizer layouts, or a decrease of
the loss, or bitwise equality after a checkpoint round trip.
"""

from __future__ import annotations

import os

import pytest
import torch

import megatron_tiny as mt
from mindspeed_rl.testing import run_on_ranks

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 4
MICRO_BATCH = 1


# ---------------------------------------------------------------------------------------
# rank bodies (module level so spawned ranks can import them)
# ---------------------------------------------------------------------------------------
def _setup(layout_kwargs, seed=7):
    from mindspeed_rl.parallel import ParallelLayout
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    layout = ParallelLayout(world_size=torch.distributed.get_world_size(), **layout_kwargs)
    initialize_megatron_parallel(layout, seed=seed)
    return layout


def _train_objects(layout, use_distributed_optimizer, num_experts=None, lr=1e-2, **config_kw):
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    extra = dict(config_kw)
    if num_experts:
        extra.update(num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=64,
                     moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
                     moe_router_load_balancing_type="none")
    config = mt.tiny_config(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        sequence_parallel=layout.sequence_parallel, **extra)
    model = mt.tiny_gpt(config, num_experts=num_experts)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # Without these two hooks DP and SP grads are silently not reduced.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=False, fp16=False,
                        use_distributed_optimizer=use_distributed_optimizer),
        [model])
    return model, optimizer


def _step(model, forward_only=False):
    """One global batch through get_forward_backward_func; returns the mean loss (all ranks)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    tokens, positions, labels = mt.batch(GLOBAL_BATCH, seed=11)
    per_dp = GLOBAL_BATCH // dp_size
    sl = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    micro = [(tokens[sl][i:i + MICRO_BATCH], positions[sl][i:i + MICRO_BATCH],
              labels[sl][i:i + MICRO_BATCH]) for i in range(0, per_dp, MICRO_BATCH)]

    def forward_step(data_iterator, model):
        tok, pos, lab = next(data_iterator)
        out = model(tok, pos, attention_mask=None, labels=lab)  # [b, s] per-token loss

        def loss_func(output):
            loss = output.float().mean()
            # clone: the schedule divides the returned loss in place by num_microbatches
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=model,
        num_microbatches=len(micro), seq_length=mt.SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=forward_only)
    # The last PP stage holds the losses; average them over micro-batches and DP ranks.
    local = torch.tensor([sum(d["loss"].item() for d in losses), len(losses)], dtype=torch.float64)
    torch.distributed.all_reduce(local)
    return (local[0] / local[1]).item()


def train_body(layout_kwargs, use_distributed_optimizer, steps, num_experts=None,
               save_init=None, load_init=None):
    """Train ``steps`` Adam steps. Initial weights may be saved to / loaded from a dist
    checkpoint so that layouts whose random init differs (PP stages, EP) start equal."""
    from megatron.core import dist_checkpointing
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    layout = _setup(layout_kwargs)
    model, optimizer = _train_objects(layout, use_distributed_optimizer, num_experts)
    if save_init:
        os.makedirs(save_init, exist_ok=True)
        dist_checkpointing.save({"model": model.module.sharded_state_dict()}, save_init)
    if load_init:
        with torch.no_grad():
            loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, load_init)
            model.module.load_state_dict(loaded["model"])
    eval_loss = _step(model, forward_only=True)
    losses, grad_norms = [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(_step(model))
        ok, grad_norm, _ = optimizer.step()
        assert ok
        grad_norms.append(float(grad_norm))
    destroy_megatron_parallel()
    return {"eval_loss": eval_loss, "losses": losses, "grad_norms": grad_norms}


def rng_body(seed):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    _setup({"tensor_model_parallel_size": 2}, seed=seed)
    default_before = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(3)
    default_after = torch.rand(3)
    # Reseeding reproduces the same streams, and forking did not consume the default stream.
    model_parallel_cuda_manual_seed(seed)
    again_default = torch.rand(6)
    with get_cuda_rng_tracker().fork():
        again_model_parallel = torch.rand(3)
    return {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "default": torch.cat([default_before, default_after]),
        "again_default": again_default,
        "model_parallel": model_parallel,
        "again_model_parallel": again_model_parallel,
    }


def checkpoint_save_body(layout_kwargs, ckpt_dir, num_experts=None):
    """Train three steps, save model + distributed-optimizer state, report the next step.

    Three steps, not one: a resumed Adam must continue at step 4, and a loader that
    restores the wrong step count (e.g. its own template's step 1) would go unnoticed
    after a single step."""
    from megatron.core import dist_checkpointing
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    layout = _setup(layout_kwargs)
    model, optimizer = _train_objects(layout, True, num_experts)
    for _ in range(3):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        _step(model)
        optimizer.step()
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(state, ckpt_dir)
    eval_loss = _step(model, forward_only=True)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    next_loss = _step(model)
    optimizer.step()
    after_next = _step(model, forward_only=True)
    destroy_megatron_parallel()
    return {"eval_loss": eval_loss, "next_loss": next_loss, "after_next": after_next}


def checkpoint_load_body(layout_kwargs, ckpt_dir, with_optimizer, num_experts=None):
    from megatron.core import dist_checkpointing
    from mindspeed_rl.parallel.groups import destroy_megatron_parallel

    layout = _setup(layout_kwargs, seed=99)  # a different seed: weights must come from disk
    model, optimizer = _train_objects(layout, True, num_experts)
    before = _step(model, forward_only=True)
    with torch.no_grad():  # fp32 main params are views of the model params
        if with_optimizer:
            # A fresh torch-Adam has no state (no 'step') to load into; create it first,
            # as megatron does for FSDP checkpoints (the values are overwritten by the load).
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                opt._init_optimizer_states_with_dummy_values()
            state = {"model": model.module.sharded_state_dict()}
            state["optimizer"] = optimizer.sharded_state_dict(
                state["model"], is_loading=True,
                metadata={"distrib_optim_sharding_type": "dp_reshardable"})
            loaded = dist_checkpointing.load(state, ckpt_dir)
            model.module.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
        else:
            loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, ckpt_dir)
            model.module.load_state_dict(loaded["model"])
    eval_loss = _step(model, forward_only=True)
    result = {"before": before, "eval_loss": eval_loss}
    if with_optimizer:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        result["next_loss"] = _step(model)
        optimizer.step()
        result["after_next"] = _step(model, forward_only=True)
    destroy_megatron_parallel()
    return result


# ---------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------
def test_layouts_agree_and_adam_decreases_loss(tmp_path):
    """DP=2, TP=2, TP=2+SP, PP=2 (1F1B over 4 micro-batches), with and without the
    distributed optimizer, all from the same initial weights: same forward-only loss, same
    per-step losses and global grad norms (layout-invariant quantities), and the loss falls
    over 4 Adam steps on a fixed batch."""
    init = str(tmp_path / "init")
    runs = {"dp2": run_on_ranks(train_body, 2, {}, False, 4, save_init=init)[0]}
    for name, layout, distopt in [
        ("dp2_distopt", {}, True),
        ("tp2", {"tensor_model_parallel_size": 2}, False),
        ("tp2_sp_distopt", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, True),
        ("pp2", {"pipeline_model_parallel_size": 2}, False),
        ("pp2_distopt", {"pipeline_model_parallel_size": 2}, True),
    ]:
        runs[name] = run_on_ranks(train_body, 2, layout, distopt, 4, load_init=init)[0]
    ref = runs["dp2"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]
    # forward_only through the schedule equals the first training forward
    assert ref["eval_loss"] == pytest.approx(ref["losses"][0], abs=1e-6)
    for name, run in runs.items():
        assert run["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5), name
        assert run["losses"] == pytest.approx(ref["losses"], abs=2e-4), name
        assert run["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4), name


def test_rng_tracker_seeds_streams_per_tp_rank():
    a = run_on_ranks(rng_body, 2, 123)
    b = run_on_ranks(rng_body, 2, 456)
    r0, r1 = sorted(a, key=lambda r: r["tp_rank"])
    # model-parallel stream differs between TP ranks, the default stream does not
    assert not torch.equal(r0["model_parallel"], r1["model_parallel"])
    assert torch.equal(r0["default"], r1["default"])
    for r in a:
        # reseeding reproduces both streams; the fork did not consume the default stream
        assert torch.equal(r["again_default"], r["default"])
        assert torch.equal(r["again_model_parallel"], r["model_parallel"])
    # seeds are really applied (a no-op manual_seed would make these equal)
    assert not torch.equal(a[0]["default"], b[0]["default"])
    assert not torch.equal(a[0]["model_parallel"], b[0]["model_parallel"])


def test_dist_checkpoint_loads_into_other_layout(tmp_path):
    saved = run_on_ranks(checkpoint_save_body, 2, {"tensor_model_parallel_size": 2},
                         str(tmp_path / "ckpt"))[0]
    # model at another layout (PP=2): identical loss
    pp = run_on_ranks(checkpoint_load_body, 2, {"pipeline_model_parallel_size": 2},
                      str(tmp_path / "ckpt"), False)[0]
    assert pp["before"] != pytest.approx(saved["eval_loss"], abs=1e-3)
    assert pp["eval_loss"] == pytest.approx(saved["eval_loss"], abs=1e-6)
    # model + distributed optimizer at the same layout: the next step is identical
    same = run_on_ranks(checkpoint_load_body, 2, {"tensor_model_parallel_size": 2},
                        str(tmp_path / "ckpt"), True)[0]
    assert same["eval_loss"] == saved["eval_loss"]
    assert same["next_loss"] == saved["next_loss"]
    assert same["after_next"] == saved["after_next"]


def test_moe_expert_parallel(tmp_path):
    """4 experts, top-2, alltoall dispatcher: EP=2 trains, and a checkpoint saved at EP=1
    gives the same loss when loaded at EP=2."""
    ep2 = run_on_ranks(train_body, 2, {"expert_model_parallel_size": 2}, False, 4, 4)[0]
    assert ep2["losses"][-1] < ep2["losses"][0] - 0.3, ep2["losses"]
    saved = run_on_ranks(checkpoint_save_body, 2, {}, str(tmp_path / "moe"), 4)[0]
    loaded = run_on_ranks(checkpoint_load_body, 2, {"expert_model_parallel_size": 2},
                          str(tmp_path / "moe"), False, 4)[0]
    assert loaded["eval_loss"] == pytest.approx(saved["eval_loss"], abs=1e-5)
