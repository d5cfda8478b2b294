"""Benchmark the TransferDock on the sample flow the trainer runs (distributed vs centralized).

Run under torchrun, e.g.::

    torchrun --nproc_per_node 4 benchmarks/bench_transfer_dock.py --algorithm grpo --mode distributed
    torchrun --nproc_per_node 4 benchmarks/bench_transfer_dock.py --algorithm ppo --mode centralized

One iteration replays the declared flow of the algorithm: the phases of
each family's default recipe (``registry.phases``) in order, each getting and putting the
columns ``mindspeed_rl/trainer/columns.py`` declares for it, through the trainer's
own ``SampleFlow`` (so the contract is checked here too), with the trainer's
consumer layouts and get sizes:

1. rollout: every generation-DP rank (``--infer-tp`` ranks each; its first rank
   writes) puts its prompts' ``n_samples_per_prompt`` rows with every rollout
   column (variable lengths, log-normal around ``--mean-len``, capped at
   ``--max-len``; DPO's pairs phase puts the same rows, its own columns only);
2. reward and (GRPO) adv on the generation writers, adv in whole groups;
3. the forward phases (reward_model with ``--reward-model``, values for PPO,
   old_log_p with ``--mini-batches`` > 1, reference_model) on the training-DP
   ranks (``--tp`` TP peers per DP rank, Megatron rank order), one get each;
4. (PPO) gae on the training-DP ranks; critic_update and update in
   ``--mini-batches`` gets per epoch;
5. retire every row.

Each phase reads every column whose declared consumers include it and writes the
columns it produces (stand-in values of the declared dtype and shape); columns no
phase of the algorithm reads are not stored, as in the trainer. Only the sample
flow is timed (stand-in compute is a few cheap tensor ops; rollout tensors are
built before the clock starts). ``seconds_per_iteration`` is the median over
``--iterations`` timed iterations of the wall time between two world barriers;
``cpu_seconds_per_iteration_all_ranks`` the median CPU time of all ranks together
(every thread, gloo's included): on a host with fewer cores than ranks, wall time
cannot drop below it / cores. Byte counts are row payload that crossed ranks in
one iteration; ``row_bytes_rank0_own_share`` is what any placement must move
through rank 0. ``collectives_per_iteration`` counts the dock's control and data
collectives on the busiest rank. Prints one JSON object on rank 0.
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
from mindspeed_rl.trainer.columns import COLUMNS  # noqa: E402
from mindspeed_rl.trainer.flow import SampleFlow  # noqa: E402
from mindspeed_rl.algorithms import registry  # noqa: E402
from mindspeed_rl.transfer_dock import ConsumerLayout, build_transfer_dock  # noqa: E402


# Each family's phase list with its default estimator under the family's name, and every
# (family, estimator) pair's as "family/estimator", as the trainer orders them.
ALGORITHMS = {**{a.name: registry.phases(a.name, a.default_estimator)
                 for a in registry.algorithms()},
              **{f"{a.name}/{e.name}": registry.phases(a.name, e.name)
                 for a in registry.algorithms() for e in registry.estimators(a.name)}}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="grpo")
    p.add_argument("--mode", choices=["distributed", "centralized"], default="distributed")
    p.add_argument("--rows", type=int, default=512, help="rows (responses) per iteration, global")
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--mean-len", type=int, default=2048, help="mean response length (tokens)")
    p.add_argument("--max-len", type=int, default=8192, help="max response length (tokens)")
    p.add_argument("--prompt-mean-len", type=int, default=256)
    p.add_argument("--tp", type=int, default=2, help="training tensor-parallel size")
    p.add_argument("--infer-tp", type=int, default=1, help="generation tensor-parallel size")
    p.add_argument("--mini-batches", type=int, default=2,
                   help="optimizer steps per iteration (gets of each update phase); > 1 "
                        "adds the old_log_p phase, as in the trainer")
    p.add_argument("--reward-model", action="store_true", help="add the reward_model phase")
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


def _phases(args) -> list[str]:
    """The algorithm's phases that touch the dock, as the trainer would run them."""
    skip = {"resharding_to_infer", "resharding_to_train"}
    if not args.reward_model:
        skip.add("reward_model")
    if args.mini_batches == 1:
        skip.add("old_log_p")
    return [p for p in ALGORITHMS[args.algorithm] if p not in skip]


def _rollout(args, rank: int, world: int, iteration: int) -> dict:
    """This rank's rollout rows (the generation writers' share; others put nothing); a
    family whose rows come from its data (DPO's pairs) puts the columns it declares."""
    if rank % args.infer_tp:
        return {}
    rows_per_writer = args.rows // (world // args.infer_tp)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration * 1009 + rank)
    n = args.n_samples_per_prompt
    prompts = rows_per_writer // n
    prompt_lens = [length for length in _lengths(prompts, args.prompt_mean_len, args.max_len, gen)
                   for _ in range(n)]
    resp_lens = _lengths(rows_per_writer, args.mean_len, args.max_len, gen)
    first_group = (iteration * world + rank) * prompts
    scalar = lambda values: [torch.tensor(v, dtype=torch.int64) for v in values]  # noqa: E731
    return {
        "prompt_ids": [torch.randint(0, 150_000, (p,), generator=gen) for p in prompt_lens],
        "response_ids": [torch.randint(0, 150_000, (r,), generator=gen) for r in resp_lens],
        "logprobs_rollout": [-torch.rand(r, generator=gen) for r in resp_lens],
        "prompt_index": scalar(range(rows_per_writer)),
        "finish_reason": scalar(0 for _ in resp_lens),
        "weight_version": scalar(iteration for _ in resp_lens),
        "group_id": scalar(first_group + i // n for i in range(rows_per_writer)),
        "sample_idx": scalar(i % n for i in range(rows_per_writer)),
    }


def _stand_in(column: str, batch) -> list[torch.Tensor]:
    """A phase's output cells: the declared dtype, [R] per response token or []."""
    col = COLUMNS[column]
    if col.shape == "[]":
        return [torch.full((), 0.5, dtype=col.dtype) for _ in batch.rows]
    return [torch.full(r.shape, -0.5, dtype=col.dtype) for r in batch["response_ids"]]  # every writing phase reads it


def _iteration(args, flow: SampleFlow, phases: list[str], rollout: dict, world: int) -> float:
    n = args.n_samples_per_prompt
    dp = flow.layouts["train"].num_dp_ranks
    dp_g = flow.layouts["gen_writers"].num_dp_ranks
    dist.barrier()
    start = time.perf_counter()
    for phase in phases:
        reads = [c for c in COLUMNS if phase in COLUMNS[c].consumers and c in flow.active]
        writes = [c for c in COLUMNS if phase in COLUMNS[c].producers and c in flow.active]
        if phase in COLUMNS["prompt_ids"].producers:  # the rows' source (DPO: its pairs)
            flow.put_rows(phase, {c: v for c, v in rollout.items() if c in writes},
                          group_size=n)
            continue
        layout = "gen_writers" if phase in ("reward", "adv") else "train"
        rows = args.rows // (dp_g if layout == "gen_writers" else dp)
        gets = args.mini_batches if phase in ("update", "critic_update") else 1
        for k in range(gets):
            batch = flow.get(phase, reads, rows // gets, layout, consumer=f"{phase}_{k}",
                             whole_groups=phase in ("adv", "preference_update"))
            out = {c: _stand_in(c, batch) for c in writes} if batch is not None else {}
            if writes:
                flow.put(phase, batch, out)
            elif batch is not None:  # an update: touch the data
                float(sum(cell.float().sum() for c in reads for cell in batch[c]))
    flow.retire_all()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts = {"train": ConsumerLayout.megatron(world, tensor_model_parallel_size=args.tp),
               "gen_writers": ConsumerLayout(tuple((k * args.infer_tp,)
                                                   for k in range(world // args.infer_tp)))}
    writers = world // args.infer_tp
    dp = layouts["train"].num_dp_ranks
    if args.rows % (writers * args.n_samples_per_prompt) or \
            args.rows % (dp * args.mini_batches * args.n_samples_per_prompt):
        raise SystemExit(f"--rows={args.rows} must split into whole prompts per generation "
                         "writer and whole mini-batches of whole groups per training DP rank")
    phases = _phases(args)
    flow = SampleFlow(build_transfer_dock(args.mode, timeout_s=args.timeout_s), phases, layouts)
    seconds, cpu_seconds, bytes_per_rank = [], [], None
    for it in range(args.warmup + args.iterations):
        rollout = _rollout(args, rank, world, it)
        flow.dock.reset_metrics()
        cpu_start = time.process_time()
        elapsed = _iteration(args, flow, phases, rollout, world)
        cpu = time.process_time() - cpu_start  # every thread of this rank, gloo's included
        slowest = [None] * world
        dist.all_gather_object(slowest, (elapsed, cpu))
        if it >= args.warmup:
            seconds.append(max(s for s, _ in slowest))
            cpu_seconds.append(sum(c for _, c in slowest))
            per_rank = [None] * world
            m = flow.dock.metrics
            dist.all_gather_object(per_rank, (m.row_bytes_sent + m.row_bytes_received,
                                              m.row_bytes_own, m.num_collectives))
            bytes_per_rank = per_rank  # the last timed iteration's; data shapes vary slightly
    if rank == 0:
        through = [t for t, _, _ in bytes_per_rank]
        print(json.dumps({
            "algorithm": args.algorithm,
            "mode": args.mode,
            "phases": phases,
            "world_size": world,
            "tp": args.tp,
            "infer_tp": args.infer_tp,
            "seconds_per_iteration": round(statistics.median(seconds), 4),
            "seconds_per_iteration_all": [round(s, 4) for s in seconds],
            "cpu_seconds_per_iteration_all_ranks": round(statistics.median(cpu_seconds), 4),
            "row_bytes_through_rank0": through[0],
            "row_bytes_rank0_own_share": bytes_per_rank[0][1],
            "row_bytes_per_rank_max": max(through),
            "row_bytes_per_rank_mean": round(sum(through) / world),
            "collectives_per_iteration": max(c for _, _, c in bytes_per_rank),
            "rows": args.rows,
            "n_samples_per_prompt": args.n_samples_per_prompt,
            "mean_len": args.mean_len,
            "max_len": args.max_len,
            "mini_batches": args.mini_batches,
            "iterations": args.iterations,
            "host_threads_per_rank": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
