"""The local code interpreter against hostile code: 20 attacks, each through the entry point
the rollout uses, ``ToolPool(load_tool_config("configs/tools/code_interpreter.yaml"))``
with the shipped settings. Against the interpreter without a sandbox (a child process as the
trainer's user) all but the memory, CPU-loop and output attacks (7-9, which its
limits stopped) succeeded: here each must fail, and the test checks the effect on the host,
not only the message.

The sandbox needs bubblewrap and unprivileged user namespaces (shell/setup_env.sh installs
bubblewrap). Where it cannot start the module is skipped with the reason printed, except
in CI (CI=true), where that is a failure: CI runs on a machine that has both.

Attacks that could harm the machine if the sandbox were broken are aimed at harmless
targets: the "outside" connect is a UDP connect (no packet is sent; it only asks for a
route), the project-tree write targets a scratch file the test creates, and the signals go
to this test process (which catches SIGTERM and is continued by a watchdog after SIGSTOP).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from mindspeed_rl.agent_tools import ToolCall, ToolPool, load_tool_config
from mindspeed_rl.agent_tools.preflight import sandbox_problem
from mindspeed_rl.agent_tools.sandbox import TMPFS_BYTES, Sandbox

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "tools" / "code_interpreter.yaml"
SECRET = "msrl-sandbox-secret-4f1d9"


@pytest.fixture(scope="module")
def pool():
    [spec] = load_tool_config(SHIPPED)
    assert not spec.unsafe_no_sandbox  # the shipped config uses the sandbox
    problem = sandbox_problem(spec.site_packages, spec.memory_limit_mb)
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the sandbox cannot start on this CI machine: {problem}")
        print(f"\ntests/test_sandbox.py skipped: the sandbox cannot start here: {problem}")
        pytest.skip(f"the sandbox cannot start here: {problem}")
    with ToolPool([spec]) as tools:
        yield tools


def run(pool, code: str):
    [result] = pool.run([(0, ToolCall("code_interpreter", {"code": textwrap.dedent(code)}, ""))])
    return result


def _host_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ---- 1-2: the file system -------------------------------------------------------------------

def test_01_reads_no_file_outside(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    result = run(pool, f"""
        import os
        for path in [{str(secret)!r}, "/etc/shadow", "/etc/passwd", {str(ROOT / "README.md")!r}]:
            try:
                print(path, open(path).read()[:40])
            except OSError as e:
                print(path, type(e).__name__)
    """)
    assert SECRET not in result.text
    assert result.text.count("FileNotFoundError") == 4, result.text


def test_02_writes_no_file_outside(pool, tmp_path):
    target = tmp_path / "pwned.txt"
    result = run(pool, f"""
        for path in [{str(target)!r}, "/pwned.txt", "/usr/lib/pwned.txt"]:
            try:
                open(path, "w").write("pwned")
                print(path, "written")
            except OSError as e:
                print(path, type(e).__name__)
        open("/tmp/scratch.txt", "w").write("the working directory is writable")
        print(open("/tmp/scratch.txt").read())
    """)
    assert not target.exists() and "written" not in result.text, result.text
    assert "the working directory is writable" in result.text


# ---- 3-4: the network -----------------------------------------------------------------------

def test_03_no_connection_to_the_hosts_loopback(pool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result = run(pool, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as e:
                print(type(e).__name__)
        """)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came
    assert "connected" not in result.text and "ConnectionRefusedError" in result.text


def test_04_no_route_outside(pool):
    # A UDP connect sends nothing: it only looks up a route (192.0.2.1 is TEST-NET-1).
    result = run(pool, """
        import socket
        print(sorted(name for _, name in socket.if_nameindex()))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(("192.0.2.1", 9))
            print("routed")
        except OSError as e:
            print(e.strerror)
    """)
    assert result.text.splitlines() == ["['lo']", "Network is unreachable"], result.text


# ---- 5-6, 10: processes ---------------------------------------------------------------------

def test_05_no_subprocess_or_shell(pool, tmp_path):
    marker = tmp_path / "shell-ran"
    result = run(pool, f"""
        import os, subprocess, sys
        print("system", os.system("touch {marker}"))
        try:
            subprocess.run([sys.executable, "-c", "print('child ran')"])
        except OSError as e:
            print("subprocess", type(e).__name__, e.errno)
    """)
    assert "child ran" not in result.text and not marker.exists()
    assert "subprocess PermissionError 1" in result.text, result.text
    assert "system 0" not in result.text


def test_06_fork_bomb_forks_nothing(pool):
    before = _host_children()
    result = run(pool, """
        import os, time
        forked = 0
        try:
            for _ in range(300):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                forked += 1
        except OSError as e:
            print("forked", forked, "then", type(e).__name__)
    """)
    assert "forked 0 then PermissionError" in result.text, result.text
    assert _host_children() - before == set()


def test_07_memory_is_limited(pool):
    result = run(pool, "x = bytearray(4 << 30)")
    assert result.error and "MemoryError" in result.text


def test_08_cpu_loop_is_stopped(pool):
    result = run(pool, "while True:\n    pass")
    [spec] = pool.specs.values()
    assert result.timed_out and result.seconds < spec.default_timeout + 2


def test_09_huge_output_is_cut(pool):
    started = time.monotonic()
    result = run(pool, """
        import sys
        for _ in range(100):
            sys.stdout.write("y" * (1 << 20))
    """)
    assert result.error and "more than 1048576 bytes" in result.text
    assert len(result.text) < (1 << 20) + 4096 and time.monotonic() - started < 10


def test_10_no_daemon_outlives_the_call(pool):
    marker = ["sleep", "987.321"]
    result = run(pool, f"""
        import os
        try:
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    os.execv("/bin/sleep", {marker!r})
                os._exit(0)
            print("daemon started")
        except OSError as e:
            print("no daemon:", type(e).__name__)
    """)
    assert "no daemon: PermissionError" in result.text, result.text
    time.sleep(0.2)
    assert [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == marker] == []


# ---- 11-14: the calling process -------------------------------------------------------------

def _signal_the_caller(pool, name: str):
    """The code sends signal ``name`` to this process (its pid as the host numbers it) and
    to its own parent."""
    return run(pool, f"""
        import os, signal
        for pid in ({os.getpid()}, os.getppid()):
            try:
                os.kill(pid, signal.{name})
                print(pid, "signalled")
            except OSError as e:
                print(pid, type(e).__name__)
    """)


def test_11_cannot_signal_the_caller(pool):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append("SIGTERM"))
    try:
        result = _signal_the_caller(pool, "SIGTERM")
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [], result.text
    assert f"{os.getpid()} ProcessLookupError" in result.text, result.text


def test_12_cannot_stop_the_caller(pool):
    # Were this process stopped, the watchdog would continue it after 20 s (and SIGCONT's
    # handler would record it), so a regression fails instead of hanging the test run.
    continued = []
    previous = signal.signal(signal.SIGCONT, lambda *_: continued.append(True))
    watchdog = subprocess.Popen(["sh", "-c", f"sleep 20; kill -CONT {os.getpid()}"])
    try:
        result = _signal_the_caller(pool, "SIGSTOP")
    finally:
        watchdog.kill()
        watchdog.wait()
        signal.signal(signal.SIGCONT, previous)
    assert continued == [], result.text
    assert f"{os.getpid()} ProcessLookupError" in result.text, result.text


def test_13_cannot_read_the_callers_environment(pool, monkeypatch):
    monkeypatch.setenv("MSRL_SANDBOX_TEST_TOKEN", SECRET)
    result = run(pool, f"""
        import os
        print(dict(os.environ))
        for pid in ({os.getpid()}, os.getppid(), "self"):
            try:
                print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as e:
                print(pid, type(e).__name__)
    """)
    assert SECRET not in result.text
    assert result.text.count("FileNotFoundError") == 3, result.text  # no /proc at all


def test_14_cannot_write_the_callers_memory(pool):
    victim = bytearray(b"caller memory untouched")
    address = ctypes.addressof((ctypes.c_char * len(victim)).from_buffer(victim))
    result = run(pool, f"""
        try:
            with open("/proc/{os.getpid()}/mem", "r+b") as mem:
                mem.seek({address})
                mem.write(b"CALLER MEMORY OVERWRITTEN")
            print("written")
        except OSError as e:
            print(type(e).__name__)
    """)
    assert victim == bytearray(b"caller memory untouched")
    assert "FileNotFoundError" in result.text and "written" not in result.text


# ---- 15-17: the project and its virtualenv --------------------------------------------------

def test_15_cannot_import_the_project(pool):
    # the project tree, the virtualenv (CI's lies inside the tree) and the folder the
    # interpreter is installed in (often a home directory) are all host paths: none shows
    hidden = [str(ROOT), sys.prefix, os.path.realpath(sys.base_prefix)]
    result = run(pool, f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        print("visible:", [p for p in {hidden!r} if os.path.exists(p)])
        import mindspeed_rl
    """)
    assert "visible: []" in result.text, \
        Sandbox.build(pool.specs["code_interpreter"].site_packages).bind_args
    assert "ModuleNotFoundError: No module named 'mindspeed_rl'" in result.text


def _try_to_write(pool, path: Path, mode: str):
    """The code writes a line that would run a program into ``path`` (``mode`` "a"/"w")."""
    return run(pool, f"""
        try:
            open({str(path)!r}, {mode!r}).write("import os; os.system('id')\\n")
            print("written")
        except OSError as e:
            print(type(e).__name__)
    """)


def test_16_cannot_write_the_project(pool):
    scratch = ROOT / f".sandbox_test_{os.getpid()}.py"  # a stand-in for a project module
    scratch.write_text("VALUE = 1\n")
    try:
        before = hashlib.sha256(scratch.read_bytes()).hexdigest()
        result = _try_to_write(pool, scratch, "a")
        assert hashlib.sha256(scratch.read_bytes()).hexdigest() == before
    finally:
        scratch.unlink()
    assert "written" not in result.text and "Error" in result.text


def test_17_cannot_write_the_virtualenv(pool):
    pth = Path(sysconfig.get_paths()["purelib"]) / "msrl_sandbox_test.pth"  # runs at start-up
    try:
        result = _try_to_write(pool, pth, "w")
        assert not pth.exists()
    finally:
        pth.unlink(missing_ok=True)
    assert "written" not in result.text and "Error" in result.text


# ---- 18: system calls through ctypes --------------------------------------------------------

@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system call numbers")
def test_18_ctypes_system_calls_are_refused(pool):
    result = run(pool, f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {{
            "ptrace_attach": (101, 16, {os.getpid()}, 0, 0),
            "process_vm_readv": (310, 1, 0, 1, 0, 1, 0),
            "mount": (165, b"none", b"/tmp", b"tmpfs", 0, 0),
            "keyctl": (250, 0, -3, 0, 0, 0),
            "unshare_user": (272, 0x10000000),
            "bpf": (321, 0, 0, 0),
            "fork": (57,),
        }}
        for name, (number, *args) in calls.items():
            ctypes.set_errno(0)
            print(name, libc.syscall(number, *args), ctypes.get_errno())
    """)
    lines = result.text.splitlines()
    assert len(lines) == 7 and all(line.endswith(" -1 1") for line in lines), result.text


# ---- 19-20: other calls, the disk -----------------------------------------------------------

def test_19_calls_cannot_see_or_tamper_with_each_other(pool):
    victim = textwrap.dedent("""
        import time
        open("/tmp/answer.txt", "w").write("42")
        time.sleep(1.5)
        print("victim reads", open("/tmp/answer.txt").read())
    """)
    attacker = textwrap.dedent("""
        import glob, os, time
        time.sleep(0.3)
        print("attacker sees", sorted(os.listdir("/tmp")), glob.glob("/tmp/*/main.py"))
        with open("/tmp/answer.txt", "w") as f:
            f.write("tampered")
    """)
    results = pool.run([(0, ToolCall("code_interpreter", {"code": victim}, "")),
                        (1, ToolCall("code_interpreter", {"code": attacker}, ""))])
    assert results[0].text == "victim reads 42\n", results[0].text
    assert results[1].text == "attacker sees ['main.py'] []\n", results[1].text


def test_20_total_disk_use_is_bounded(pool):
    result = run(pool, """
        written = 0
        try:
            for i in range(3):
                with open(f"/tmp/big{i}", "wb") as f:
                    f.write(b"0" * (30 << 20))
                written += 1
        except OSError as e:
            print("stopped after", written, e.strerror)
    """)
    assert f"stopped after {TMPFS_BYTES // (30 << 20)} No space left on device" in result.text, \
        result.text


# ---- no silent downgrade --------------------------------------------------------------------

def test_the_run_is_refused_where_the_sandbox_cannot_start(tmp_path, monkeypatch):
    """No bwrap on PATH: the config check (before any process group) names the tool and
    the three ways on; the launcher prints it as its one error line (tests/test_bad_input.py
    checks that for every ConfigError)."""
    import json

    from mindspeed_rl.config import ConfigError, load_config
    from mindspeed_rl.models.tiny import make_tiny_hf_dir
    from mindspeed_rl.agent_tools import preflight

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")
    model = make_tiny_hf_dir("qwen2", tmp_path / "qwen2", max_position_embeddings=2048)
    monkeypatch.setenv("PATH", str(tmp_path))          # no bwrap here
    monkeypatch.setattr(preflight, "_PROBED", {})
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "grpo_tiny_test.yaml", [
            f"megatron_training.model={model}", f"megatron_training.data_path={data}",
            f"megatron_training.log_dir={tmp_path / 'logs'}",
            "megatron_training.prompt_type=qwen_retool", "megatron_training.seq_length=1000",
            "rl_config.multi_turn_enable=true", f"rl_config.tool_config_path={SHIPPED}",
            "rl_config.max_total_response_length=112", "rl_config.max_prompt_length=1000",
            "generate_config.max_model_len=1120"])
    message = str(e.value)
    assert message.startswith(f"rl_config.tool_config_path='{SHIPPED}'")
    for fragment in ("tool 'code_interpreter'", "bubblewrap (bwrap) is not installed",
                     "apt-get install bubblewrap", "SandboxFusion", "sandbox_fusion_url",
                     "unsafe_no_sandbox: true"):
        assert fragment in message, (fragment, message)


def test_unsandboxed_opt_in_warns_once(capfd, monkeypatch):
    from dataclasses import replace

    from mindspeed_rl.agent_tools import preflight, sandbox

    [spec] = load_tool_config(SHIPPED)
    unsafe = replace(spec, unsafe_no_sandbox=True)
    monkeypatch.setattr(sandbox, "_WARNED_UNSANDBOXED", False)
    monkeypatch.delenv("RANK", raising=False)
    assert preflight.local_interpreter_problem(unsafe, str(SHIPPED)) is None
    with ToolPool([unsafe]) as tools:
        [result] = tools.run([(0, ToolCall("code_interpreter", {"code": "print(6 * 7)"}, ""))])
    assert result.ok and result.text == "42\n"
    err = capfd.readouterr().err
    assert err.count("WITHOUT a sandbox") == 1, err


# ---- the trainer protects itself ------------------------------------------------------------

_PROBE_SELF = """
import ctypes, os, subprocess, sys
if sys.argv[1] == "launch":
    from mindspeed_rl.trainer.launch import launch
    launch(["--config", "/nonexistent/job.yaml"], prog="probe", algorithm="grpo")  # refused: 2
child = subprocess.run([sys.executable, "-c", f"open('/proc/{os.getpid()}/mem', 'r+b')"],
                       capture_output=True, text=True)
print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), "PermissionError" in child.stderr)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_the_trainer_is_not_dumpable():
    """Every launcher run starts by making its process non-dumpable: a process of the same
    user without CAP_SYS_PTRACE (here both run as root without it, as in a default Docker
    container) can then no longer open its memory (/proc/<pid>/mem, ptrace); before, it
    could."""
    if subprocess.run(["setpriv", "--version"], capture_output=True).returncode != 0:
        pytest.skip("setpriv (util-linux) is not installed")
    outputs = {}
    for how in ("plain", "launch"):
        done = subprocess.run(["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-c",
                               _PROBE_SELF, how], capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
        outputs[how] = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else \
            done.stderr[-2000:]
    assert outputs == {"plain": "1 False", "launch": "0 True"}, outputs
