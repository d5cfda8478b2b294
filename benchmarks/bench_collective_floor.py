"""The fixed cost of one dock collective on this host: a gloo ``all_to_all_single``.

Run under torchrun, e.g.::

    torchrun --nproc_per_node 4 benchmarks/bench_collective_floor.py

Every rank calls ``all_to_all_single`` back to back (``--calls`` times per
payload size, after a warm-up), as the TransferDock's control collective does.
Prints one JSON object on rank 0: per payload size (bytes per peer), the mean
over ranks of wall milliseconds per call, main-thread CPU milliseconds per call
and process CPU milliseconds per call (gloo's worker threads included). The
TransferDock benchmark's iteration makes 23 (distributed) or 46 (centralized)
such calls; on a host with fewer cores than ranks this cost is what both modes
share.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 16464, 1 << 20],
                   help="payload bytes per peer (16464: the dock's control block at 4 ranks)")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=600), backend="gloo")
    result = {"world_size": world, "cpu_count": os.cpu_count(), "calls": args.calls, "sizes": {}}
    for size in args.sizes:
        send = torch.zeros(world * size, dtype=torch.uint8)
        recv = torch.empty_like(send)
        for _ in range(10):
            dist.all_to_all_single(recv, send, group=group)
        dist.barrier(group=group)
        wall, main_cpu, proc_cpu = time.perf_counter(), time.thread_time(), time.process_time()
        for _ in range(args.calls):
            dist.all_to_all_single(recv, send, group=group)
        mine = torch.tensor([time.perf_counter() - wall, time.thread_time() - main_cpu,
                             time.process_time() - proc_cpu], dtype=torch.float64)
        dist.all_reduce(mine, group=group)
        wall_ms, main_ms, proc_ms = (mine / world / args.calls * 1000).tolist()
        result["sizes"][str(size)] = {"wall_ms_per_call": round(wall_ms, 3),
                                      "main_thread_cpu_ms_per_call": round(main_ms, 3),
                                      "process_cpu_ms_per_call": round(proc_ms, 3)}
    if rank == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
