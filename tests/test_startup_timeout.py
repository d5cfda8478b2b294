"""Start-up has its own bound (rl_config.startup_timeout_s): ranks that reach start-up's
collectives far apart do not fail the job, and once start-up ends every group waits its own
bound again (mindspeed_rl/parallel/groups.py)."""

from __future__ import annotations

import time
from datetime import timedelta

from mindspeed_rl.testing.multiprocess import run_on_ranks

COLLECTIVE_S = 0.5  # the job's collective bound in these runs
LATE_S = 2.0  # how late rank 1 comes: past COLLECTIVE_S, within the other bounds
OWN_S = 20.0  # a group's own bound (the TransferDock's transfer_dock_timeout_s)


def _late_all_reduce(group=None) -> str:
    """All-reduce with rank 1 arriving LATE_S late: 'ok', or the error's class."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(LATE_S)
    try:
        dist.all_reduce(torch.ones(1), group=group)
        return "ok"
    except RuntimeError as error:
        return type(error).__name__


def _start_then_train() -> dict[str, str]:
    import torch.distributed as dist

    from mindspeed_rl.parallel import groups
    from mindspeed_rl.platform import setup_platform

    dist.destroy_process_group()  # the helper's; the launcher's own start instead
    groups.init_distributed(setup_platform(), timeout_s=COLLECTIVE_S, startup_timeout_s=60)
    own = groups.new_group(None, timeout_s=OWN_S, backend="gloo")  # as the TransferDock's
    made_like_vllm = dist.new_group(backend="gloo",  # as vLLM's (_fixed_engine_kwargs)
                                    timeout=timedelta(seconds=groups.group_timeout_s()))
    seen = {"startup world": _late_all_reduce(),
            "startup like vLLM": _late_all_reduce(made_like_vllm),
            "startup bound for a new group": str(groups.group_timeout_s(OWN_S))}
    groups.end_startup()
    seen["bound for a new group"] = str(groups.group_timeout_s(OWN_S))
    seen["own"] = _late_all_reduce(own)  # its own bound, not lowered to the job's
    seen["like vLLM"] = _late_all_reduce(made_like_vllm)  # lowered to COLLECTIVE_S
    return seen


def test_startup_waits_its_own_bound_then_each_group_its_own():
    seen = run_on_ranks(_start_then_train, 2, timeout=150)[0]  # rank 0 waited for rank 1
    assert seen == {"startup world": "ok", "startup like vLLM": "ok",
                    "startup bound for a new group": "60.0", "bound for a new group": "20.0",
                    "own": "ok", "like vLLM": "RuntimeError"}, seen


def test_startup_bound_defaults_to_the_larger_of_collective_and_600():
    from mindspeed_rl.parallel.groups import startup_bound

    assert startup_bound(10, None) == 600
    assert startup_bound(1800, None) == 1800
    assert startup_bound(10, 30) == 30  # set: taken as is


def test_a_startup_timeout_names_the_startup_bound():
    from mindspeed_rl.fault.collective import describe_collective_failure
    from mindspeed_rl.fault.phase_tracker import PhaseTracker

    tracker = PhaseTracker()  # no store: no peers to read
    error = RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")
    line = describe_collective_failure(error, tracker, 10, 600)
    assert tracker.phase == "startup"
    assert "got no answer within the start-up bound of 600 s (rl_config.startup_timeout_s)" \
        in line, line
    tracker.enter("update")
    line = describe_collective_failure(error, tracker, 10, 600)
    assert "within rl_config.collective_timeout_s=10 s" in line, line
