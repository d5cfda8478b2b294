"""Benchmark the TransferDock on a GRPO-shaped iteration (distributed vs centralized).

Run under torchrun, e.g.::

    torchrun --nproc_per_node 4 benchmarks/bench_transfer_dock.py --mode distributed
    torchrun --nproc_per_node 4 benchmarks/bench_transfer_dock.py --mode centralized

One iteration replays the sample flow of GRPO (DESIGN.md section 5):

1. rollout: every generation-DP rank (TP_g = 1, so every rank) puts its prompts'
   ``n_samples_per_prompt`` responses: prompt ids, response ids, rollout
   log-probs (variable lengths, log-normal around ``--mean-len``, capped at
   ``--max-len``), a scalar reward and the response length;
2. old log-probs and 3. ref log-probs: training-DP consumers (TP = ``--tp``
   peers per DP rank, Megatron rank order) get prompt + response ids in
   ``--forward-gets`` gets (default: ``--mini-batches``; ``pretrain_grpo.py``
   takes all rows in one get) and put their log-probs back (every TP peer puts,
   as TP ranks all hold the reduced result);
4. advantages: training-DP ranks get rewards in whole groups, put per-token
   advantages back;
5. update: training-DP ranks get everything the loss needs, in mini-batches;
6. clear.

Only the sample flow is timed (stand-in compute is a few cheap tensor ops; the
rollout tensors are built before the clock starts). ``seconds_per_iteration``
is the median over ``--iterations`` timed iterations of the wall time between
two world barriers; ``cpu_seconds_per_iteration_all_ranks`` is the median of
the CPU time all ranks spent in it together (all threads, so gloo's too): on a
host with fewer cores than ranks, wall time cannot drop below it / cores. Byte
counts are row payload that crossed ranks in one iteration (identical every
iteration); ``row_bytes_rank0_own_share`` is what
any placement must move through rank 0 (cells it computed that another rank
uses for the first time, plus cells it uses for the first time that another
rank computed). ``collectives_per_iteration`` counts the dock's control and
data collectives on the busiest rank. Prints one JSON object on rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from mindspeed_rl.transfer_dock import ConsumerLayout, build_transfer_dock  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["distributed", "centralized"], default="distributed")
    p.add_argument("--rows", type=int, default=512, help="rows (responses) per iteration, global")
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--mean-len", type=int, default=2048, help="mean response length (tokens)")
    p.add_argument("--max-len", type=int, default=8192, help="max response length (tokens)")
    p.add_argument("--prompt-mean-len", type=int, default=256)
    p.add_argument("--tp", type=int, default=2, help="training tensor-parallel size")
    p.add_argument("--mini-batches", type=int, default=4, help="gets of the update phase")
    p.add_argument("--forward-gets", type=int, default=None,
                   help="gets per log-prob phase (default: --mini-batches)")
    p.add_argument("--iterations", type=int, default=7, help="timed iterations (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600)
    return p.parse_args()


def _lengths(num: int, mean: int, cap: int, gen: torch.Generator) -> list[int]:
    """Log-normal lengths (sigma 0.6, a typical long-tailed response distribution)."""
    sigma = 0.6
    mu = math.log(mean) - sigma ** 2 / 2
    raw = torch.exp(torch.randn(num, generator=gen, dtype=torch.float64) * sigma + mu)
    return [int(x) for x in raw.clamp(8, cap).round()]


def _rollout(args, rank: int, world: int, iteration: int) -> tuple[dict, list[int]]:
    rows_per_rank = args.rows // world
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration * 1009 + rank)
    n = args.n_samples_per_prompt
    prompt_lens = [length for length in _lengths(rows_per_rank // n, args.prompt_mean_len,
                                                 args.max_len, gen) for _ in range(n)]
    resp_lens = _lengths(rows_per_rank, args.mean_len, args.max_len, gen)
    cols = {
        "prompt_ids": [torch.randint(0, 150_000, (p,), generator=gen) for p in prompt_lens],
        "response_ids": [torch.randint(0, 150_000, (r,), generator=gen) for r in resp_lens],
        "logprobs_rollout": [-torch.rand(r, generator=gen) for r in resp_lens],
        "rewards": [torch.rand((), generator=gen) for _ in resp_lens],
        "response_length": [torch.tensor(r) for r in resp_lens],
    }
    return cols, [p + r for p, r in zip(prompt_lens, resp_lens)]


def _iteration(args, dock, layout: ConsumerLayout, rollout: dict, token_lengths: list[int]) -> float:
    world = dist.get_world_size()
    num_rows = args.rows // world * world
    per_dp = num_rows // layout.num_dp_ranks
    per_get = per_dp // args.mini_batches
    per_forward_get = per_dp // args.forward_gets
    dist.barrier()
    start = time.perf_counter()

    dock.put(rollout, token_lengths=token_lengths, num_rows_per_group=args.n_samples_per_prompt)
    for consumer, out in (("actor_logprobs", "logprobs_old"), ("ref_logprobs", "logprobs_ref")):
        for _ in range(args.forward_gets):
            batch = dock.get(consumer, ["prompt_ids", "response_ids"], per_forward_get, layout)
            # stand-in for a forward pass: [num_tokens] float32 per row
            dock.put({out: [torch.full(r.shape, -0.5) for r in batch["response_ids"]]},
                     rows=batch.rows)
    batch = dock.get("compute_advantages", ["rewards", "response_length"], per_dp, layout,
                     whole_groups=True)
    n = args.n_samples_per_prompt
    rewards = torch.stack(batch["rewards"]).view(-1, n)  # [num_groups, n]
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6))
    dock.put({"advantages": [a.expand(int(length)).clone() for a, length in
                             zip(adv.reshape(-1), batch["response_length"])]}, rows=batch.rows)
    checksum = 0.0
    for _ in range(args.mini_batches):
        batch = dock.get("actor_update", ["prompt_ids", "response_ids", "logprobs_rollout",
                                          "logprobs_old", "logprobs_ref", "advantages"],
                         per_get, layout)
        checksum += float(sum(a.sum() for a in batch["advantages"]))  # touch the data
    dock.clear()

    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    args = _parse()
    args.forward_gets = args.forward_gets or args.mini_batches
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = ConsumerLayout.megatron(world, tensor_model_parallel_size=args.tp)
    rows_per_rank = args.rows // world
    per_dp = rows_per_rank * world // layout.num_dp_ranks
    if rows_per_rank % args.n_samples_per_prompt or per_dp % (args.mini_batches *
                                                              args.n_samples_per_prompt) \
            or per_dp % args.forward_gets:
        raise SystemExit(f"--rows={args.rows} must split into whole prompts per rank, whole "
                         f"mini-batches of whole groups per training DP rank and "
                         f"--forward-gets={args.forward_gets} equal gets per training DP rank")
    dock = build_transfer_dock(args.mode, timeout_s=args.timeout_s)
    seconds, cpu_seconds, bytes_per_rank = [], [], None
    for it in range(args.warmup + args.iterations):
        rollout, token_lengths = _rollout(args, rank, world, it)
        dock.reset_metrics()
        cpu_start = time.process_time()
        elapsed = _iteration(args, dock, layout, rollout, token_lengths)
        cpu = time.process_time() - cpu_start  # every thread of this rank, gloo's included
        slowest = [None] * world
        dist.all_gather_object(slowest, (elapsed, cpu))
        if it >= args.warmup:
            seconds.append(max(s for s, _ in slowest))
            cpu_seconds.append(sum(c for _, c in slowest))
            per_rank = [None] * world
            m = dock.metrics
            dist.all_gather_object(per_rank, (m.row_bytes_sent + m.row_bytes_received,
                                              m.row_bytes_own, m.num_collectives))
            bytes_per_rank = per_rank  # the last timed iteration's; data shapes vary slightly
    if rank == 0:
        through = [t for t, _, _ in bytes_per_rank]
        print(json.dumps({
            "mode": args.mode,
            "world_size": world,
            "tp": args.tp,
            "seconds_per_iteration": round(statistics.median(seconds), 4),
            "seconds_per_iteration_all": [round(s, 4) for s in seconds],
            "cpu_seconds_per_iteration_all_ranks": round(statistics.median(cpu_seconds), 4),
            "row_bytes_through_rank0": through[0],
            "row_bytes_rank0_own_share": bytes_per_rank[0][1],
            "row_bytes_per_rank_max": max(through),
            "row_bytes_per_rank_mean": round(sum(through) / world),
            "collectives_per_iteration": max(c for _, _, c in bytes_per_rank),
            "rows": rows_per_rank * world,
            "n_samples_per_prompt": args.n_samples_per_prompt,
            "mean_len": args.mean_len,
            "max_len": args.max_len,
            "mini_batches": args.mini_batches,
            "forward_gets": args.forward_gets,
            "iterations": args.iterations,
            "host_threads_per_rank": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
