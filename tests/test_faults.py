"""Faults under torchrun, as a user meets them: a hung rank in each phase, a full disk during a
save, SIGTERM, a killed rank of a 2-node job. Each job must end within a bound, print one line
that says what happened as its last line, leave no process and no half-written checkpoint
behind, and resume from its last complete checkpoint to the uninterrupted run's numbers.

Runs go through ``python -m mindspeed_rl.fault.torchrun`` (what the shell launchers use) and
the test hook ``MINDSPEED_RL_FAULT_INJECT`` (``mindspeed_rl.fault.injection``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from mindspeed_rl.data import make_arithmetic_problems, write_jsonl
from mindspeed_rl.models.tiny import make_tiny_hf_dir
from mindspeed_rl.testing.multiprocess import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_tiny_test.yaml"
TIMEOUT_S = 10  # rl_config.collective_timeout_s of these runs
# A survivor reports within the timeout plus a few heartbeats; the slack covers a loaded
# 2-core machine. It bounds the report, not the speed of anything.
REPORT_BOUND_S = TIMEOUT_S + 40
# torchrun gives a rank 30 s to act on SIGTERM before SIGKILL (a stopped rank never acts).
JOB_BOUND_S = 300
COMPARED = ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
            "actor/entropy", "actor/grad_norm", "actor/lr")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    train, _ = make_arithmetic_problems(64, 8, seed=0, max_operand=20, ops="+")
    write_jsonl(train, root / "train.jsonl")
    return {"root": root, "model": make_tiny_hf_dir("qwen2", root / "qwen2"),
            "data": root / "train.jsonl"}


_running: list["Job"] = []  # the current test's jobs
_started: list["Job"] = []  # every job of the module (Launches counts the busy ones)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """A failed assertion must not leave a job running into the next test."""
    yield
    while _running:
        _running.pop().kill_tree()


JOB_MARKER_ENV = "MINDSPEED_RL_TEST_JOB"  # which job a process belongs to (assert_nothing_left)


class Job:
    """A launched job: its output lines with arrival times, and its end."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, marker: str,
                 mine: bool = True):
        if mine:  # else the module's until a test takes it (Launches)
            _running.append(self)
        _started.append(self)
        self.marker = marker
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[tuple[float, str]] = []
        self.fault_fired = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic() - self.start, line.rstrip("\n")))
            self.fault_fired = self.fault_fired or "[fault injection]" in line
        self.output_ended = time.monotonic()  # (its test may wait for it later)

    def busy(self) -> bool:
        """Still working: not ended, and no injected fault yet (after one, the job mostly
        waits: for the collective timeout, torchrun's teardown)."""
        return self.proc.poll() is None and not self.fault_fired

    def wait(self, timeout: float = JOB_BOUND_S) -> int:
        """The exit status; ``timeout`` counts from the job's start (a job the module
        started ahead of its test has been running meanwhile)."""
        try:
            rc = self.proc.wait(timeout=max(1.0, self.start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"job did not end within {timeout} s:\n" + self.text[-4000:])
        self._reader.join(timeout=10)
        self.elapsed = getattr(self, "output_ended", time.monotonic()) - self.start
        return rc

    def kill_tree(self) -> None:
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in procs + [self.proc]:
            try:
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        self.proc.wait()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def last_line(self) -> str:
        return next(line for _, line in reversed(self.lines) if line.strip())

    def first(self, pattern: str) -> tuple[float, str]:
        for t, line in self.lines:
            if re.search(pattern, line):
                return t, line
        raise AssertionError(f"no line matches {pattern!r}:\n" + self.text[-4000:])

    def assert_nothing_left(self) -> None:
        """No process of this job survives it: every rank's command line holds the run's
        unique log folder, and every process the job started (helpers the ranks spawn, such
        as megatron-core's checkpoint-writer queue manager) inherits it in its environment."""
        deadline = time.monotonic() + 10
        while True:
            left = [p for p in psutil.process_iter(["pid", "cmdline", "environ"])
                    if self.marker in " ".join(p.info["cmdline"] or [])
                    or (p.info["environ"] or {}).get(JOB_MARKER_ENV) == self.marker]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, [(p.pid, p.info["cmdline"][:3]) for p in left]


def start(assets, name: str, *overrides: str, inject: str | None = None,
          torchrun_args: tuple[str, ...] = ("--nproc_per_node", "2"), mine: bool = True) -> Job:
    """A 2-rank job; with ``inject`` the collective timeout is TIMEOUT_S, else generous (a
    busy machine must not turn a slow rank into a false fault). ``mine``: the calling
    test's (else the module's until a test takes it: Launches)."""
    run_dir = assets["root"] / name
    cmd = [sys.executable, "-m", "mindspeed_rl.fault.torchrun", *torchrun_args,
           str(ROOT / "pretrain_grpo.py"), "--config", str(CONFIG),
           f"megatron_training.model={assets['model']}",
           f"megatron_training.data_path={assets['data']}",
           f"megatron_training.log_dir={run_dir / 'logs'}",
           "megatron_training.train_iters=2",
           f"rl_config.collective_timeout_s={TIMEOUT_S if inject else 300}", *overrides]
    marker = f"log_dir={run_dir / 'logs'}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1",
               **{JOB_MARKER_ENV: marker})
    env.pop("MINDSPEED_RL_FAULT_INJECT", None)
    if inject:
        env["MINDSPEED_RL_FAULT_INJECT"] = inject
    # Every rank's command line holds its log folder, and no other job's does.
    return Job(cmd, env, assets["root"], marker=marker, mine=mine)


def rows(assets, name: str) -> dict[int, dict]:
    path = assets["root"] / name / "logs" / "metrics.jsonl"
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "timing/all" in row:
            out[row["iteration"]] = row
    return out


def assert_same_iteration(a: dict, b: dict) -> None:
    for key in COMPARED:
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


# At most this many jobs work at once (each has 2 ranks; the machine may have 2 cores): a
# job whose injected fault fired only waits (for the collective timeout, for torchrun's
# teardown) and does not count, so the next job's work overlaps that wait.
BUSY_MAX = 2
HUNG_PHASES = ("rollout", "resharding_to_infer", "reference_model", "update")


class Launches:
    """The module's jobs, started ahead of the tests that assert on them, in the order the
    tests take them: the next one starts while fewer than BUSY_MAX jobs are busy
    (:meth:`Job.busy`) and the launch it comes ``after`` has ended. A test that takes a
    launch not started yet starts it at once. What a test takes is its own from then on
    (killed when the test ends); :meth:`close` kills what no test took."""

    def __init__(self, plan: list[tuple[str, str | None, object]]):
        self._plan = list(plan)  # (name, after, start: () -> list[Job])
        self._jobs: dict[str, list[Job]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _start_next(self, name: str | None = None) -> None:
        """Start the first launch whose ``after`` has ended (``name``: only that one)."""
        with self._lock:
            for item in self._plan:
                launch, after, starter = item
                if (name in (None, launch) and (after is None or after in self._jobs and all(
                        job.proc.poll() is not None for job in self._jobs[after]))):
                    self._plan.remove(item)
                    self._jobs[launch] = []  # stays empty if the start fails
                    self._jobs[launch] = starter()
                    return

    def _run(self) -> None:
        while self._plan and not self._closed:
            if sum(job.busy() for job in _started) < BUSY_MAX:
                self._start_next()
            time.sleep(0.2)

    def take(self, name: str) -> list[Job]:
        deadline = time.monotonic() + 2 * JOB_BOUND_S
        while name not in self._jobs:
            assert any(item[0] == name for item in self._plan), f"{name} is not planned"
            assert time.monotonic() < deadline, f"{name} did not start"
            self._start_next(name)
            time.sleep(0.2)
        with self._lock:
            jobs = self._jobs[name]
        assert jobs, f"{name} failed to start"
        _running.extend(jobs)
        return jobs

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        with self._lock:
            for jobs in self._jobs.values():
                for job in jobs:
                    job.kill_tree()


def _start_preempted(assets) -> list[Job]:
    """The preemption job, and a thread that sends torchrun SIGTERM (as a scheduler does)
    as soon as the first iteration is logged (``job.signalled``: when)."""
    ckpt = assets["root"] / "preempt" / "ckpt"
    job = start(assets, "preempt", "megatron_training.train_iters=50",
                f"actor_config.save={ckpt}", mine=False)
    job.signalled = None
    metrics = assets["root"] / "preempt" / "logs" / "metrics.jsonl"

    def signal_after_first_iteration():
        while job.proc.poll() is None:
            if metrics.is_file() and '"timing/all"' in metrics.read_text():
                job.signalled = time.monotonic()
                job.proc.send_signal(signal.SIGTERM)
                return
            time.sleep(0.2)

    threading.Thread(target=signal_after_first_iteration, daemon=True).start()
    return [job]


def _start_refused_loads(assets) -> list[Job]:
    """Two loads of the disk-full job's checkpoint that must be refused at start-up: with
    the other optimizer layout, and from a copy with a truncated shard."""
    ckpt = assets["root"] / "enospc" / "ckpt"
    damaged = assets["root"] / "enospc_resume" / "ckpt"
    shutil.copytree(ckpt, damaged)
    shard = sorted((damaged / "iter_0000001").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    # Optimizer state has no conversion between sharded and unsharded layouts.
    flipped = start(assets, "enospc_flip", f"actor_config.load={ckpt}",
                    "megatron_training.use_distributed_optimizer=false", mine=False)
    bad = start(assets, "enospc_resume", f"actor_config.load={damaged}", mine=False)
    bad.shard = shard
    return [flipped, bad]


@pytest.fixture(scope="module")
def launches(request, assets):
    """Every job the selected tests of this module assert on, planned at the first of them
    (dependent runs, which need a test's assertions first, are started by their tests)."""
    def job(name, *overrides, inject=None):
        return lambda: [start(assets, name, *overrides, inject=inject, mine=False)]

    ckpt = assets["root"] / "hang_ckpt" / "ckpt"
    enospc = assets["root"] / "enospc" / "ckpt"
    # The plan's order is the order of the tests, but for the longest chain, hang_ckpt and
    # its resume, first (a launch a test takes before the plan reaches it starts at once).
    plan = [  # (name, after, start, the tests that take it)
        ("hang_ckpt", None, job("hang_ckpt", "megatron_training.save_interval=1",
                                f"actor_config.save={ckpt}", inject="checkpoint:1:2"),
         {"test_hung_rank_in_checkpoint_save_then_resume_reproduces"}),
        ("reference", None, job("reference", "megatron_training.train_iters=4"),
         {"test_console_shows_iterations_not_noise",
          "test_hung_rank_in_checkpoint_save_then_resume_reproduces",
          "test_sigterm_saves_a_checkpoint_and_exits_zero"}),
        *((f"hang_{phase}", None, job(f"hang_{phase}", "megatron_training.train_iters=1",
                                      inject=f"{phase}:1"),
           {f"test_hung_rank_ends_the_job_with_one_line[{phase}]"}) for phase in HUNG_PHASES),
        ("enospc", None, job("enospc", "megatron_training.save_interval=1",
                             f"actor_config.save={enospc}",
                             inject="checkpoint_write:1:2:enospc"),
         {"test_disk_full_during_save_keeps_the_previous_checkpoint"}),
        ("refused_loads", "enospc", lambda: _start_refused_loads(assets),
         {"test_disk_full_during_save_keeps_the_previous_checkpoint"}),
        ("preempt", None, lambda: _start_preempted(assets),
         {"test_sigterm_saves_a_checkpoint_and_exits_zero"}),
    ]
    selected = {item.name for item in request.session.items if item.module is request.module}
    launches = Launches([entry[:3] for entry in plan if entry[3] & selected])
    yield launches
    launches.close()


@pytest.fixture(scope="module")
def reference_job(launches):
    """The uninterrupted run: 4 iterations."""
    job, = launches.take("reference")
    assert job.wait() == 0, job.text[-4000:]
    return job


@pytest.fixture(scope="module")
def reference(assets, reference_job):
    return rows(assets, "reference")


def test_console_shows_iterations_not_noise(reference_job):
    """A healthy run prints its plan, one line per iteration and nothing of the known noise
    (mindspeed_rl.metrics.console lists it)."""
    text = reference_job.text
    assert all(f"iter {i}/4 | reward" in text for i in range(1, 5))
    for noise in ("INFO", "Processed prompts", "Rendering prompts", "Failed to load weights",
                  "UserWarning", "FutureWarning", "DeprecationWarning", "requires_grad",
                  "The global random seed", "libtcmalloc", "Setting OMP_NUM_THREADS"):
        assert noise not in text, noise


# ---------------------------------------------------------------------------------------
# a hung rank
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", HUNG_PHASES)
def test_hung_rank_ends_the_job_with_one_line(launches, phase):
    """Rank 1 stops (SIGSTOP) on entering ``phase``; rank 0 reports within the timeout,
    naming its own phase and the stopped rank's, and torchrun ends the job."""
    job, = launches.take(f"hang_{phase}")
    rc = job.wait()
    print(f"\n[{phase}] job ended after {job.elapsed:.1f} s")
    assert rc == 1, job.text[-4000:]
    stopped_at, _ = job.first(r"\[fault injection\] rank 1: stop")
    reported_at, line = job.first(r"^pretrain_grpo\.py: error: rank 0: ")
    print(f"[{phase}] rank 0 reported {reported_at - stopped_at:.1f} s after rank 1 stopped: "
          f"{line}")
    assert reported_at - stopped_at < REPORT_BOUND_S
    assert f"rl_config.collective_timeout_s={TIMEOUT_S} s" in line
    assert f"not responding: rank 1 (phase '{phase}' of iteration 1" in line
    assert job.last_line() == line  # the error is what the user sees last
    assert "Traceback" not in job.text
    job.assert_nothing_left()


def test_hung_rank_in_checkpoint_save_then_resume_reproduces(assets, launches, reference):
    """Rank 1 stops in the save of iteration 2: no half-written checkpoint, ``latest`` names
    iteration 1, and resuming from it reproduces the uninterrupted iteration 2."""
    ckpt = assets["root"] / "hang_ckpt" / "ckpt"
    job, = launches.take("hang_ckpt")
    assert job.wait() == 1, job.text[-4000:]
    _, line = job.first(r"^pretrain_grpo\.py: error: rank 0: ")
    assert "phase 'checkpoint' of iteration 2" in line and "not responding: rank 1" in line
    assert job.last_line() == line
    job.assert_nothing_left()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]

    resumed = start(assets, "hang_ckpt", f"actor_config.load={ckpt}",
                    f"actor_config.save={ckpt}")
    assert resumed.wait() == 0, resumed.text[-4000:]
    after = rows(assets, "hang_ckpt")
    assert sorted(after) == [1, 2]
    assert_same_iteration(after[2], reference[2])


# ---------------------------------------------------------------------------------------
# a full disk during a save
# ---------------------------------------------------------------------------------------
def test_disk_full_during_save_keeps_the_previous_checkpoint(assets, launches):
    from mindspeed_rl.checkpoint import verify_checkpoint

    ckpt = assets["root"] / "enospc" / "ckpt"
    job, = launches.take("enospc")
    assert job.wait() == 2, job.text[-4000:]
    line = job.last_line()
    assert line.startswith("pretrain_grpo.py: error: ")
    assert "iter_0000002: saving iteration 2 failed (rank 1: OSError" in line
    assert "No space left on device" in line and "latest_checkpointed_iteration.txt still" in line
    assert "Traceback" not in job.text
    job.assert_nothing_left()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]
    verify_checkpoint(ckpt / "iter_0000001")  # whole: every file as its manifest says

    # Then (_start_refused_loads) two loads of it, refused at start-up. Optimizer state
    # has no conversion between sharded and unsharded layouts:
    flipped, bad = launches.take("refused_loads")
    assert flipped.wait() == 2, flipped.text[-4000:]
    assert flipped.last_line() == (
        f"pretrain_grpo.py: error: {ckpt / 'iter_0000001'}: its optimizer state was saved with "
        "megatron_training.use_distributed_optimizer=true and cannot be loaded with "
        "megatron_training.use_distributed_optimizer=false (no conversion between the two "
        "layouts); set megatron_training.use_distributed_optimizer: true, or "
        "actor_config.no_load_optim: true to keep the weights and start a fresh optimizer")
    flipped.assert_nothing_left()

    # A damaged checkpoint (a copy of it with a truncated shard) is refused at start-up
    # with the file named.
    assert bad.wait() == 2, bad.text[-4000:]
    assert f"{bad.shard}: truncated: 100 bytes" in bad.last_line()
    bad.assert_nothing_left()


# ---------------------------------------------------------------------------------------
# preemption
# ---------------------------------------------------------------------------------------
def test_sigterm_saves_a_checkpoint_and_exits_zero(assets, launches, reference):
    """SIGTERM to torchrun (as a scheduler sends it) once the first iteration is logged
    (_start_preempted): the ranks agree at the next iteration boundary, save, and the job
    exits 0; the checkpoint resumes to the reference numbers."""
    ckpt = assets["root"] / "preempt" / "ckpt"
    job, = launches.take("preempt")
    rc = job.wait()
    signalled = job.signalled
    assert signalled is not None, "ended before its first iteration:\n" + job.text[-4000:]
    assert rc == 0, job.text[-4000:]
    print(f"\nexited {job.start + job.elapsed - signalled:.1f} s after SIGTERM")
    for t, line in job.lines:
        if t >= signalled - job.start:
            print(f"  +{t - (signalled - job.start):5.1f} s {line[:160]}")
    done = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= done <= 3
    assert job.last_line() == (f"pretrain_grpo.py: stopped by SIGTERM after iteration {done}; "
                               f"checkpoint of iteration {done} in {ckpt}")
    assert "Traceback" not in job.text
    job.assert_nothing_left()
    assert sorted(rows(assets, "preempt")) == list(range(1, done + 1))

    resumed = start(assets, "preempt", f"megatron_training.train_iters={done + 1}",
                    f"actor_config.load={ckpt}")
    assert resumed.wait() == 0, resumed.text[-4000:]
    assert_same_iteration(rows(assets, "preempt")[done + 1], reference[done + 1])


SECOND_SIGTERM_SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from mindspeed_rl.fault.preemption import preemption
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
preemption.install(120)
print(f"ready {dist.get_rank()} {os.getpid()}", flush=True)
if dist.get_rank() == 1:
    # Never joins the barrier (rank 0 waits inside a C++ collective); leaves when torchrun
    # stops it after rank 0 exited.
    deadline = time.monotonic() + 60
    while not preemption.requested and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0)
dist.barrier()
"""


def test_second_sigterm_exits_at_once_even_inside_a_collective(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(SECOND_SIGTERM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                 "")]))
    job = Job([sys.executable, "-m", "mindspeed_rl.fault.torchrun", "--nproc_per_node", "2",
               str(script)], env, tmp_path, marker=str(script))
    deadline = time.monotonic() + 60
    while not re.search(r"ready 0 \d+", job.text):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = int(re.search(r"ready 0 (\d+)", job.text).group(1))
    time.sleep(0.5)  # rank 0 is inside the barrier
    os.kill(pid, signal.SIGTERM)
    time.sleep(2.5)  # later than the repeat window: a second request, not an echo
    second = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() - second < 2.0, "rank 0 did not exit at once"
        time.sleep(0.05)
    assert job.wait(60) == 143
    assert f"rank 0 (pid {pid}) exited with status 143" in job.text
    assert "second SIGTERM: exiting at once" in job.text
    job.assert_nothing_left()


# ---------------------------------------------------------------------------------------
# a killed rank of a 2-node job
# ---------------------------------------------------------------------------------------
def test_two_node_job_with_a_killed_rank_ends_with_one_line_per_node(assets):
    """Two torchrun agents on one host (a c10d rendezvous on localhost), one rank each; rank 0
    SIGKILLs itself in the rollout. Both nodes end within seconds; each ends with one line
    and no agent traceback (RendezvousConnectionError, ChildFailedError)."""
    port = free_port()
    jobs = [start(assets, "two_nodes", inject="rollout:0::kill", torchrun_args=(
        "--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1", "--rdzv_backend",
        "c10d", "--rdzv_endpoint", f"localhost:{port}", "--rdzv_id", f"job{port}"))
        for n in range(2)]
    codes = [job.wait() for job in jobs]
    print("\n" + "\n".join(f"node {n}: rc={c} after {j.elapsed:.1f} s, last line: "
                           f"{j.last_line()}" for n, (j, c) in enumerate(zip(jobs, codes))))
    assert all(c == 1 for c in codes)
    killed, = [j for j in jobs if "[fault injection] rank 0: kill" in j.text]
    survivor, = [j for j in jobs if j is not killed]
    assert re.fullmatch(r"torchrun: error: rank 0 \(pid \d+\) was killed by SIGKILL",
                        killed.last_line())
    last = survivor.last_line()
    assert (last.startswith("torchrun: error: this node lost the job's rendezvous")
            or last.startswith("pretrain_grpo.py: error: rank 1: a ")), last
    for job in jobs:
        assert "Traceback" not in job.text and "RendezvousConnectionError:" not in job.text
        job.assert_nothing_left()


def agreement_body() -> list[str]:
    """Rank 1 alone receives SIGTERM; at the boundary every rank stops, rank 0 included."""
    import torch.distributed as dist

    from mindspeed_rl.fault.preemption import Preempted, preemption

    preemption.install(60)
    outcomes = []
    try:
        preemption.check(2)
        outcomes.append("went on")
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the watcher thread sets the flag
        preemption.check(3)
        outcomes.append("went on")
    except Preempted as stop:
        outcomes.append(f"stopped before {stop.next_iteration}")
    finally:
        preemption.uninstall()
    return outcomes


def test_ranks_agree_on_a_sigterm_only_one_received():
    from mindspeed_rl.testing import run_on_ranks

    assert run_on_ranks(agreement_body, 2, timeout=120) == [["went on", "stopped before 3"]] * 2


def disagreeing_tracker_body(base: str, stale_rank: int) -> list[str]:
    """Each rank has its own save folder (a node-local file system): on ``stale_rank`` the
    tracker already names iteration 3, on the other it names 2. The save is collective."""
    import torch.distributed as dist

    from mindspeed_rl.trainer.launch_guard import LaunchGuard
    from mindspeed_rl.fault.preemption import Preempted, preemption

    rank = dist.get_rank()
    save_dir = Path(base) / f"node{rank}"
    save_dir.mkdir(parents=True)
    (save_dir / "latest_checkpointed_iteration.txt").write_text(
        "3\n" if rank == stale_rank else "2\n")
    guard = LaunchGuard.__new__(LaunchGuard)  # no heartbeats: only the preemption path
    guard.prog, guard.save_dir, guard.first_iteration, guard.timeout_s = "job", str(save_dir), 0, 60
    preemption.install(60)
    saves = []
    try:
        status = guard.failed(Preempted(4), save_checkpoint=lambda: saves.append("saved"))
        # Both ranks get here whatever they decided: compare instead of hanging in a save.
        outcomes = [None, None]
        dist.all_gather_object(outcomes, (status, saves))
    finally:
        preemption.uninstall()
    return outcomes


def stopping_body() -> tuple[int, str]:
    """A SIGTERM arrived (the agent stops this rank), then the work it cut off raised."""
    import contextlib
    import io

    import mindspeed_rl.trainer.launch_guard as launch_guard
    from mindspeed_rl.fault.preemption import preemption

    def exit_(code):
        raise SystemExit(code)

    launch_guard._exit = exit_
    guard = launch_guard.LaunchGuard.__new__(launch_guard.LaunchGuard)
    guard.prog, guard.save_dir, guard.first_iteration, guard.timeout_s = "job", None, 0, 60
    preemption.install(60)
    err = io.StringIO()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not preemption.requested and time.monotonic() < deadline:
            time.sleep(0.05)  # the watcher thread sets the flag
        try:
            raise RuntimeError("C++ compile failed\nat::vec has not been declared")
        except RuntimeError as error:
            with contextlib.redirect_stderr(err):
                try:
                    guard.failed(error)
                except SystemExit as stop:
                    return stop.code, err.getvalue()
    finally:
        preemption.uninstall()
    return 0, err.getvalue()


def test_an_error_while_the_agent_stops_the_rank_is_one_line():
    """A rank the agent is stopping (another node failed) whose cut-off work raises says so
    in one line, not with a traceback (the error file keeps the trace)."""
    from mindspeed_rl.testing import run_on_ranks

    code, text = run_on_ranks(stopping_body, 1, timeout=120)[0]
    assert code == 1 and "Traceback" not in text, text
    assert text.strip().splitlines()[-1] == (
        "job: error: stopped by SIGTERM in phase 'startup'; while stopping: RuntimeError: C++ "
        "compile failed"), text


@pytest.mark.parametrize("stale_rank, expected", [(1, ["saved"]), (0, [])],
                         ids=["rank1_reads_saved", "rank0_reads_saved"])
def test_ranks_save_together_when_their_tracker_reads_differ(tmp_path, stale_rank, expected):
    """Whether to save is rank 0's reading, broadcast: all ranks save, or all skip."""
    from mindspeed_rl.testing import run_on_ranks

    results = run_on_ranks(disagreeing_tracker_body, 2, str(tmp_path), stale_rank, timeout=120)
    assert results[0] == results[1] == [(0, expected), (0, expected)]
