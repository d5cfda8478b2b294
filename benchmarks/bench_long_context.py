"""Memory and time of one layer's core attention, forward + backward, by sequence length.

    python benchmarks/bench_long_context.py [--lengths 2048 4096 8192 16384 32768] \\
        [--megatron-max 16384] [--head-dim 128] [--repeats 2] [--gqa-length 4096]

Compares megatron-core's local ``DotProductAttention`` (what every model was built with
before: ``[b, heads, s, s]`` scores and an fp32 softmax copy) with our ``SDPAttention``
(`mindspeed_rl/models/attention.py`: ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal``), both as megatron's attention module calls them: ``[s, 1, heads, d]``
query/key/value, fp32, causal, one head (and 4 query heads over 1 KV head for the
grouped-query case at ``--gqa-length``).

Each measurement runs in a fresh process (one gloo rank, megatron's parallel state at TP 1).
``peak_mib`` is the rise of the process's resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` once q/k/v exist; glibc's mmap threshold fixed at 64 KiB
so that freed tensors leave the resident set) over a forward + backward after one
warm-up pass: outputs, saved activations, gradients and kernel buffers, not the inputs
themselves (the largest of ``--repeats`` passes). ``seconds`` is the fastest of them. Lengths above ``--megatron-max`` are
skipped for megatron's attention (``L^2`` memory). The last stdout line is one JSON object::

    {"attention": {"sdpa": {"2048": {"peak_mib": ..., "seconds": ...}, ...},
                   "megatron_local": {...}},
     "gqa_4to1": {"length": 4096, "sdpa": {...}, "megatron_local": {...}},
     "micro_batch": {"length": 16384, "cp1": {...}, "cp2_ring": {...}, "cp2_ulysses": {...}},
     "head_dim": 128, "threads": ..., "device": "cpu"}

``micro_batch`` (``--micro-batch-length``, 0 to skip): one packed row of that many tokens
through a tiny random qwen2 (hidden 256, 4 layers, 8 query / 4 KV heads, vocabulary 384;
fp32), forward + backward of the sum of its log-probs and entropies with the engine's
context-parallel path (`mindspeed_rl.engine.cp_micro_batch`), on 1 rank (CP 1) and on 2
gloo ranks (CP 2, ring and Ulysses): each rank's ``VmHWM`` rise (the largest rank is
reported) and the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measure_one(impl: str, length: int, heads: int, groups: int, head_dim: int,
                repeats: int) -> dict:
    """Forward + backward of one attention module in this process (see the module doc)."""
    import torch
    import torch.distributed as dist

    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_rl.models.attention import SDPAttention
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.parallel.ports import free_port
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    initialize_megatron_parallel(ParallelLayout(1, 1, 1), seed=1)
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim,
                               num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=head_dim, attention_dropout=0.0,
                               use_cpu_initialization=True)
    cls = {"sdpa": SDPAttention, "megatron_local": DotProductAttention}[impl]
    module = cls(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(length, 1, heads, head_dim, generator=g, requires_grad=True)
    k = torch.randn(length, 1, groups, head_dim, generator=g, requires_grad=True)
    v = torch.randn(length, 1, groups, head_dim, generator=g, requires_grad=True)
    grad_out = torch.randn(length, 1, heads * head_dim, generator=g)
    module(q, k, v, None).backward(grad_out)  # warm-up: thread pool, kernel selection
    seconds, peak = [], 0
    for _ in range(repeats):
        q.grad = k.grad = v.grad = None
        base = _status_kib("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        module(q, k, v, None).backward(grad_out)
        seconds.append(time.perf_counter() - start)
        peak = max(peak, _status_kib("VmHWM") - base)
    dist.destroy_process_group()
    return {"peak_mib": round(peak / 1024, 1), "seconds": round(min(seconds), 3)}


def measure_micro_batch(hf_dir: str, length: int, algo: str) -> dict:
    """One rank of the micro-batch measurement (torch.distributed already initialised by
    torchrun): the largest rank's VmHWM rise and the seconds of forward + backward."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mindspeed_rl.engine.actor import response_entropy, response_logprobs
    from mindspeed_rl.engine.cp_micro_batch import ContextParallelOutputs, local_inputs
    from mindspeed_rl.engine.micro_batches import RowBatch, make_micro_batches
    from mindspeed_rl.config.batch_plan import MicroBatching
    from mindspeed_rl.engine.packing import packed_inputs
    from mindspeed_rl.models.builder import (build_gpt_model, build_transformer_config,
                                             describe_hf_dir)
    from mindspeed_rl.parallel.context_parallel import row_multiple
    from mindspeed_rl.parallel.groups import initialize_megatron_parallel
    from mindspeed_rl.parallel.layout import ParallelLayout
    from mindspeed_rl.platform import setup_platform

    setup_platform()
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    initialize_megatron_parallel(ParallelLayout(cp, context_parallel_size=cp), seed=1)
    arch = describe_hf_dir(hf_dir)
    model = build_gpt_model(arch, build_transformer_config(arch, context_parallel_algo=algo))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (16,), generator=g)
    batch = RowBatch([prompt], [torch.randint(3, 300, (length - 16,), generator=g)], {})
    (mb,) = make_micro_batches(batch, MicroBatching(micro_batch_size=1, packed=True),
                               row_multiple=row_multiple(cp) if cp > 1 else 1)
    packing = packed_inputs(model)

    def step():
        if cp > 1:
            tokens, positions, index = local_inputs(mb)
        else:
            tokens, positions, index = mb.tokens, mb.positions, None
        logits = model(tokens, positions, **packing.arguments(mb))
        packing.done()
        if cp > 1:
            logits = ContextParallelOutputs(logits, mb, index)
        else:
            logits = logits[:, mb.response_index[0]]
        loss = (response_logprobs(logits, mb, arch.vocab_size).sum()
                + response_entropy(logits, arch.vocab_size).sum())
        loss.backward()

    step()  # warm-up
    model.zero_grad()
    base = _status_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak = torch.tensor([(_status_kib("VmHWM") - base) / 1024, seconds])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.destroy_process_group()
    return {"peak_mib": round(float(peak[0]), 1), "seconds": round(float(peak[1]), 3)}


# glibc keeps freed blocks resident and raises its mmap threshold to the largest freed
# block, so a pass after the warm-up could reuse memory without raising the high-water mark.
# A fixed threshold (this disables the dynamic one) maps every block of 64 KiB or more on its
# own and unmaps it when freed: the resident set follows the live tensors.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _micro_batch(hf_dir: str, length: int, ranks: int, algo: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(ranks), os.path.abspath(__file__), "--one-micro-batch", hf_dir, str(length), algo]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, **_MALLOC_ENV})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _in_fresh_process(impl, length, heads, groups, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", impl, str(length), str(heads),
           str(groups), "--head-dim", str(args.head_dim), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, **_MALLOC_ENV})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--megatron-max", type=int, default=16384)
    p.add_argument("--gqa-length", type=int, default=4096, help="0: skip")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--micro-batch-length", type=int, default=16384, help="0: skip")
    p.add_argument("--one", nargs=4, metavar=("IMPL", "LENGTH", "HEADS", "GROUPS"),
                   help=argparse.SUPPRESS)
    p.add_argument("--one-micro-batch", nargs=3, metavar=("HF_DIR", "LENGTH", "ALGO"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    with stdout_reserved_for_json() as emit:
        if args.one_micro_batch:
            hf_dir, length, algo = args.one_micro_batch
            result = measure_micro_batch(hf_dir, int(length), algo)
            if int(os.environ.get("RANK", "0")) == 0:
                emit(result)
            return
        if args.one:
            impl, length, heads, groups = args.one
            emit(measure_one(impl, int(length), int(heads), int(groups), args.head_dim,
                             args.repeats))
            return
        import torch

        attention = {"sdpa": {}, "megatron_local": {}}
        for length in args.lengths:
            for impl in attention:
                if impl == "megatron_local" and length > args.megatron_max:
                    continue
                attention[impl][str(length)] = _in_fresh_process(impl, length, 1, 1, args)
                print(impl, length, attention[impl][str(length)], file=sys.stderr)
        gqa = {"length": args.gqa_length, "heads": 4, "kv_heads": 1}
        for impl in ("sdpa", "megatron_local") if args.gqa_length else ():
            gqa[impl] = _in_fresh_process(impl, args.gqa_length, 4, 1, args)
        micro = {"length": args.micro_batch_length}
        if args.micro_batch_length:
            import tempfile

            from mindspeed_rl.models.tiny import make_tiny_hf_dir

            with tempfile.TemporaryDirectory() as tmp:
                hf_dir = str(make_tiny_hf_dir(
                    "qwen2", os.path.join(tmp, "qwen2"), seed=0, hidden_size=256,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    max_position_embeddings=max(args.micro_batch_length, 256)))
                for name, ranks, algo in (("cp1", 1, "megatron_cp_algo"),
                                          ("cp2_ring", 2, "megatron_cp_algo"),
                                          ("cp2_ulysses", 2, "ulysses_cp_algo")):
                    micro[name] = _micro_batch(hf_dir, args.micro_batch_length, ranks, algo)
                    print("micro-batch", name, micro[name], file=sys.stderr)
        emit({"attention": attention, "gqa_4to1": gqa, "micro_batch": micro,
              "head_dim": args.head_dim,
              "dtype": "float32", "threads": torch.get_num_threads(), "device": "cpu"})


if __name__ == "__main__":
    main()
