"""Side by side: the update and the reference log-prob forward of one ragged batch with
today's padded micro-batches and with token-budget / packed micro-batches.

Run under torchrun with a job config (its model, layout and optimizer)::

    torchrun --nproc_per_node 2 benchmarks/bench_micro_batches.py \\
        --config configs/grpo_smollm2_demo.yaml --variants off,budget:1024,packed:512

The batch is one training step's rows of the config (``global_batch_size x
n_samples_per_prompt``): real prompts from ``megatron_training.data_path`` and
responses whose lengths are as ragged as a trained policy's (``--mean-response``
tokens on average, exponential, clipped to ``[1, max_tokens]``, one row at
``max_tokens``; token ids random: the compute does not depend on them). Each
variant is one micro-batch layout:

* ``off``: the config's fixed ``micro_batch_size`` rows, padded to the batch's longest
  row (the layout without ``use_dynamic_bsz`` / ``use_remove_padding``);
* ``budget:N``: token-budget micro-batches of at most N tokens, each padded to its own
  longest row;
* ``packed:N``: token-budget micro-batches of at most N tokens, packed.

The variants run in turns (off, on, off, on, ...) in one process, so that a change of
the machine's load hits them alike. Rank 0 prints one JSON line with, per variant,
the median seconds of the update and of the forward, their useful model FLOPs rate
(``mindspeed_rl.metrics.flops``, real tokens only) per device, padding efficiency,
micro-batch count, and the compute floor (useful FLOPs over the matmul peak
measured on every rank at once before and after).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from json_report import stdout_reserved_for_json  # noqa: E402 - benchmarks/ is on sys.path

PROG = "bench_micro_batches.py"


def _parse(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--variants", default="off,packed:512",
                   help="comma-separated layouts: off, budget:N, packed:N (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="turns of every variant (default 2)")
    p.add_argument("--mean-response", type=float, default=12.0,
                   help="mean response length of the batch (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_intermixed_args(argv)


def _variant(text: str, fixed_rows: int):
    from mindspeed_rl.config.batch_plan import MicroBatching

    if text == "off":
        return MicroBatching(micro_batch_size=fixed_rows)
    kind, _, budget = text.partition(":")
    if kind not in ("budget", "packed") or not budget.isdigit():
        raise SystemExit(f"{PROG}: error: variant {text!r} is not off, budget:N or packed:N")
    return MicroBatching(micro_batch_size=fixed_rows, max_tokens=int(budget),
                         packed=kind == "packed")


def ragged_batch(config, rows: int, mean: float, seed: int, vocab: int):
    """Real prompts and ragged random responses (one row at max_tokens)."""
    import torch
    from transformers import AutoTokenizer

    from mindspeed_rl.data import load_prompt_dataset
    from mindspeed_rl.engine.micro_batches import RowBatch

    mt, rl = config.megatron_training, config.rl_config
    longest = config.sampling_config.max_tokens
    tok = AutoTokenizer.from_pretrained(mt.tokenizer_name_or_path or config.model.hf_dir)
    data = load_prompt_dataset(mt.data_path, tok, rl.max_prompt_length, prompt_key=mt.prompt_key,
                               answer_key=mt.answer_key, seed=mt.seed)
    rng = random.Random(seed)
    n = rl.n_samples_per_prompt
    prompts = [torch.tensor(data[i // n].prompt_ids) for i in range(rows)]
    lengths = [min(longest, max(1, round(rng.expovariate(1 / mean)))) for _ in range(rows - 1)]
    lengths.insert(rng.randrange(rows), longest)
    g = torch.Generator().manual_seed(seed)
    responses = [torch.randint(0, vocab, (k,), generator=g) for k in lengths]
    extras = {"advantages": [torch.randn((), generator=g).expand(k).clone() for k in lengths],
              "logprobs_ref": [-torch.rand(k, generator=g) for k in lengths]}
    return RowBatch(prompts, responses, extras)


def main(argv=None) -> int:
    args = _parse(argv)
    from mindspeed_rl.trainer.launch import load_job

    config, plan = load_job(args.config, args.overrides, algorithm="grpo")
    with stdout_reserved_for_json() as emit:
        result = run(args, config, plan)
        if result is not None:
            emit(result)
    return 0


def run(args, config, plan):
    import torch
    import torch.distributed as dist

    from mindspeed_rl.metrics.flops import matmul_gflops, row_forward_flops
    from mindspeed_rl.models.builder import describe_hf_dir, load_hf_weights
    from mindspeed_rl.models.hf_io import HFCheckpointReader
    from mindspeed_rl.parallel.groups import (init_distributed, initialize_megatron_parallel,
                                              teardown_distributed)
    from mindspeed_rl.platform import setup_platform
    from mindspeed_rl.engine.actor import MegatronActor, build_policy_model, forward_logprobs
    from mindspeed_rl.engine.efficiency import take_counts

    platform = setup_platform()
    init_distributed(platform)
    try:
        mt, rl = config.megatron_training, config.rl_config
        initialize_megatron_parallel(plan.layout, seed=mt.seed)
        rank, world = dist.get_rank(), dist.get_world_size()
        arch = describe_hf_dir(config.model.hf_dir)
        model = build_policy_model(arch, params_dtype=torch.float32,
                                   sequence_parallel=mt.sequence_parallel)
        load_hf_weights(model, arch, HFCheckpointReader(config.model.hf_dir))
        actor = MegatronActor(model, config.actor_config, total_steps=1000,
                              use_distributed_optimizer=mt.use_distributed_optimizer, bf16=False)
        rows = plan.batch.responses_per_mini_batch_per_training_dp_rank
        dp_rank = rank // (plan.layout.tensor_model_parallel_size
                           * plan.layout.pipeline_model_parallel_size)
        batch = ragged_batch(config, rows, args.mean_response, args.seed + dp_rank,
                             arch.vocab_size)
        lengths = [(len(p), len(r)) for p, r in zip(batch.prompts, batch.responses)]
        useful = sum(row_forward_flops(config.model, p, r) for p, r in lengths)
        useful = torch.tensor([useful], dtype=torch.float64)
        dist.all_reduce(useful)
        useful = useful.item() / (plan.layout.tensor_model_parallel_size
                                  * plan.layout.pipeline_model_parallel_size)

        def peak():
            dist.barrier()
            t = torch.tensor([matmul_gflops(seconds=2.0)], dtype=torch.float64)
            dist.all_reduce(t)
            return t.item() / world

        peak_before = peak()
        names = args.variants.split(",")
        specs = {name: _variant(name, config.actor_config.micro_batch_size) for name in names}
        ref_specs = {name: _variant(name, rl.ref_forward_micro_batch_size) for name in names}
        times = {name: {"update": [], "forward": []} for name in names}
        counts = {}
        for turn in range(args.repeats):
            for name in names:
                dist.barrier()
                take_counts()
                start = time.perf_counter()
                actor.update(batch, specs[name], rl, kl_coef=rl.init_kl_coef,
                             vocab_size=arch.vocab_size)
                dist.barrier()
                times[name]["update"].append(time.perf_counter() - start)
                c = take_counts()
                start = time.perf_counter()
                forward_logprobs(model, batch, ref_specs[name], arch.vocab_size)
                dist.barrier()
                times[name]["forward"].append(time.perf_counter() - start)
                f = take_counts()
                counts[name] = (c.real / c.computed, f.real / f.computed)
                if rank == 0:
                    print(f"[{PROG}] turn {turn} {name}: update "
                          f"{times[name]['update'][-1]:.2f} s, forward "
                          f"{times[name]['forward'][-1]:.2f} s", file=sys.stderr, flush=True)
        peak_after = peak()
        peak_gflops = (peak_before + peak_after) / 2
        response = [r for _, r in lengths]
        out = {"config": config.config_path, "world_size": world, "rows_per_dp_rank": rows,
               "response_length_mean": statistics.mean(response),
               "response_length_max": max(response),
               "prompt_length_mean": statistics.mean(p for p, _ in lengths),
               "useful_tflops_update": 3 * useful / 1e12, "useful_tflops_forward": useful / 1e12,
               "matmul_peak_gflops_per_device": {"before": round(peak_before, 2),
                                                 "after": round(peak_after, 2)},
               "compute_floor_s": {"update": round(3 * useful / (peak_gflops * 1e9 * world), 3),
                                   "forward": round(useful / (peak_gflops * 1e9 * world), 3)},
               "variants": {}}
        for name in names:
            upd, fwd = statistics.median(times[name]["update"]), statistics.median(
                times[name]["forward"])
            out["variants"][name] = {
                "layout": specs[name].describe(),
                "update_s": [round(t, 3) for t in times[name]["update"]],
                "forward_s": [round(t, 3) for t in times[name]["forward"]],
                "update_useful_gflops_per_device": round(3 * useful / upd / world / 1e9, 2),
                "forward_useful_gflops_per_device": round(useful / fwd / world / 1e9, 2),
                "update_mfu": round(3 * useful / upd / world / 1e9 / peak_gflops, 4),
                "padding_efficiency_update": round(counts[name][0], 4),
                "padding_efficiency_forward": round(counts[name][1], 4),
            }
        base = out["variants"].get("off")
        if base:
            for name in names:
                v = out["variants"][name]
                for phase in ("update", "forward"):
                    key = f"{phase}_useful_gflops_per_device"
                    v[f"{phase}_speedup_vs_off"] = round(v[key] / base[key], 3)
        return out if rank == 0 else None
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main())
