"""How long a preemption's checkpoint save takes, against the time the job has for it.

After SIGTERM, torchrun sends SIGKILL ``--shutdown-timeout`` seconds later (its
environment variable ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; 30 s by default); the scheduler
has its own window before that (SLURM: ``--signal=TERM@<seconds>`` ahead of the time
limit, ``KillWait`` after it). ``rl_config.save_on_sigterm_grace_s`` states that window.
The save writes each rank's share of the weights and optimizer state (the plan's memory
figures for the heaviest rank) and then reads it back to hash it (the manifest); the
estimate divides those bytes by a write and a hash speed measured in the save folder,
assuming the file system gives every rank that speed at once (a shared file system
saturated by many ranks is slower: treat the estimate as a lower bound there).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

_PROBE_BYTES = 64 << 20


def checkpoint_bytes_per_rank(memory_bytes: dict[str, int], parameters: dict[str, int] | None = None,
                              adapters_only: bool = False) -> int:
    """What the heaviest rank writes in a trainer checkpoint: its weights, its optimizer
    state and, with PPO, the critic's (the plan's ``memory_bytes``). ``adapters_only``
    (LoRA with ``lora_ckpt_filter``): of the weights, only the adapters' share (the plan's
    ``parameters``) is written."""
    params = memory_bytes.get("actor_params", 0)
    adapters = (parameters or {}).get("adapter_per_rank", 0)
    if adapters_only and adapters:
        params = params * adapters // (parameters["training_per_rank"] + adapters)
    return params + memory_bytes.get("actor_optimizer", 0) + memory_bytes.get("critic", 0)


def measure_speeds(folder: str | os.PathLike, nbytes: int = _PROBE_BYTES) -> tuple[float, float]:
    """(write, hash) bytes per second in ``folder`` (or its nearest existing parent): one
    file of ``nbytes`` written and fsynced, then read back through SHA-256, then removed."""
    where = Path(folder).absolute()
    while not where.is_dir():
        where = where.parent
    block = os.urandom(1 << 20)
    fd, name = tempfile.mkstemp(prefix=".save_speed_probe.", dir=where)
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        written = time.perf_counter()
        digest = hashlib.sha256()
        with open(name, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        hashed = time.perf_counter()
    finally:
        os.unlink(name)
    size = max(1, nbytes >> 20) << 20
    return size / max(written - start, 1e-6), size / max(hashed - written, 1e-6)


def save_estimate(nbytes: int, write_bps: float, hash_bps: float, grace_s: float
                  ) -> tuple[float, str]:
    """(seconds, the line that says so: a warning naming the fixes past ``grace_s``)."""
    seconds = nbytes / write_bps + nbytes / hash_bps
    line = (f"checkpoint save on SIGTERM: about {seconds:.0f} s ({nbytes / 2**30:.1f} GiB per "
            f"rank at {write_bps / 2**20:.0f} MiB/s written, {hash_bps / 2**20:.0f} MiB/s "
            f"hashed); rl_config.save_on_sigterm_grace_s={grace_s:g}")
    if seconds > grace_s:
        line = ("warning: " + line + f": a preempted run is killed before its save ends; give "
                f"the job more time after SIGTERM (torchrun --shutdown-timeout "
                f"{int(seconds * 1.5) + 1}, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT, and the "
                "scheduler's signal lead, e.g. SLURM --signal=TERM@<seconds>) and set "
                "rl_config.save_on_sigterm_grace_s to match; or save more often "
                "(megatron_training.save_interval)")
    return seconds, line


def save_time_line(config, plan) -> str | None:
    """The estimate for ``config``'s save folder (None when it saves nothing)."""
    save = config.actor_config.save
    if not save:
        return None
    write_bps, hash_bps = measure_speeds(save)
    nbytes = checkpoint_bytes_per_rank(plan.memory_bytes, plan.parameters,
                                       adapters_only=config.actor_config.lora_ckpt_filter)
    return save_estimate(nbytes, write_bps, hash_bps, config.rl_config.save_on_sigterm_grace_s)[1]
