"""The multi-process test helper: results by rank, failures and hangs surface as errors."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from mindspeed_rl.testing import RankFailure, run_on_ranks


def allreduce_body(offset):
    t = torch.tensor([dist.get_rank() + offset], dtype=torch.float32)
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.environ["RANK"]


def failing_body():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait forever for rank 1


def hanging_body():
    time.sleep(600)


def helper_then_failing_body(pid_file):
    """Rank 0 starts a helper process (a multiprocessing manager, as megatron's checkpoint
    writer does) and waits; rank 1 fails."""
    import multiprocessing as mp

    if dist.get_rank() == 0:
        manager = mp.get_context("spawn").Manager()
        with open(pid_file, "w") as f:
            f.write(str(manager._process.pid))
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_results_in_rank_order():
    results = run_on_ranks(allreduce_body, 3, 10)
    assert results == [(0, 3, 33.0, "0"), (1, 3, 33.0, "1"), (2, 3, 33.0, "2")]


def test_failure_on_one_rank_is_reported_and_nothing_hangs():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 of 2 failed in failing_body(.|\n)*boom on rank one"):
        run_on_ranks(failing_body, 2, timeout=120)
    assert time.monotonic() - start < 60


def test_timeout_names_the_ranks_still_running():
    with pytest.raises(RankFailure, match=r"timed out after 3s; ranks still running: \[0, 1\]"):
        run_on_ranks(hanging_body, 2, timeout=3)


def test_failure_stops_the_helpers_a_rank_started(tmp_path):
    """A rank stopped after another's failure takes the processes it started with it: none is
    left holding the session's output open."""
    import psutil

    pid_file = tmp_path / "helper.pid"
    with pytest.raises(RankFailure, match="boom on rank one"):
        run_on_ranks(helper_then_failing_body, 2, str(pid_file), timeout=120)
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(helper).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the helper process {helper} of the stopped rank is still running")
