"""The local code interpreter: the model's Python run in an OS sandbox, with limits.

Model output is untrusted input, and a policy trained with RL finds whatever the reward pays
for, so each call runs in its own interpreter inside a bubblewrap sandbox with a seccomp
filter (mindspeed_rl.agent_tools.sandbox: its own user, PID, network, IPC and mount namespaces, a
read-only view of only the Python runtime and the allowed packages, a private size-limited
/tmp, no /proc, no network, no new processes), killed (SIGKILL) with everything it started
when the call ends, however it ends.

Limits: wall clock (``timeout_s``, from the moment the call was dispatched), CPU time
(RLIMIT_CPU, the wall limit rounded up + 1 s), address space (RLIMIT_AS =
``memory_limit_mb``), file size (RLIMIT_FSIZE) and, in the sandbox, all files together
(the tmpfs), no core files, open files, and a cap on the output read back
(``max_output_bytes`` per stream; a program past it is stopped). The interpreter is
``python -I -S -B -u`` (no PYTHON* variables, no user site, no site-packages: only the
packages the tool config names, bound under /opt/site; no .pyc; unbuffered output so a
crash loses nothing printed) with an environment of a few fixed variables: nothing of the
trainer's (tokens, keys) reaches the code.

The code and the limits go to the child through its stdin and argv: its start-up code
(``_BOOT``, ours, run before any of the model's code) reads the code, sets its own limits
(lowering limits needs no privilege), points stdin at /dev/null and runs the code as
``__main__`` from ``main.py`` in its working directory. No ``preexec_fn``, which is unsafe
in the threaded trainer. The child keeps its end of the stdin pipe and kills its process
group when the pipe closes, so calls in flight die with a rank that is killed (in the
sandbox bwrap's ``--die-with-parent`` does it too).

``sandboxed=False`` (the tool config's ``unsafe_no_sandbox: true``) runs the same child
without the sandbox, as the trainer's user in the trainer's file system and network, in a
fresh directory under TMPDIR: it stops code that loops, allocates or prints too much, not
hostile code (docs/tools.md).
"""

from __future__ import annotations

import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mindspeed_rl.agent_tools.result import ToolResult, timeout_text
from mindspeed_rl.agent_tools.sandbox import WORKDIR, Sandbox, warn_unsandboxed

MAX_OUTPUT_BYTES = 1 << 20
FILE_SIZE_LIMIT = 64 << 20
OPEN_FILES_LIMIT = 256
SPARE_PROCESSES = 256  # unsandboxed: processes a call may add (RLIMIT_NPROC counts the user's)

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        # numpy/BLAS in many concurrent calls: one thread each, not one per core each
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Run by the child with -c LIMITS [SITE_DIR]. Reads the code (8-byte length, then UTF-8)
# from stdin, writes it to main.py, sets its limits (only ever lowering one), adds the
# allowed packages' folder to sys.path, points stdin at /dev/null, watches the parent's
# pipe (EOF: the rank is gone: remove the working directory the rank cannot remove now,
# kill the group), then runs main.py as __main__ and prints a traceback without this
# wrapper's frames.
_BOOT = r"""
import os, sys, resource, _thread
def _take(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(70)
        data += chunk
    return data
with open("main.py", "wb") as f:
    f.write(_take(int.from_bytes(_take(8), "big")))
for _item in sys.argv[1].split(","):
    _name, _value = _item.split("=")
    _soft, _hard = map(int, _value.split(":"))
    _which = getattr(resource, "RLIMIT_" + _name)
    _now = resource.getrlimit(_which)[1]
    if _now != resource.RLIM_INFINITY:
        _soft, _hard = min(_soft, _now), min(_hard, _now)
    resource.setrlimit(_which, (_soft, _hard))
if len(sys.argv) > 2:
    sys.path.append(sys.argv[2])
_pipe = os.dup(0)
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
def _watch(fd=_pipe, home=os.getcwd()):
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        return
    try:
        import shutil
        shutil.rmtree(home, ignore_errors=True)
    finally:
        os.killpg(0, 9)
_thread.start_new_thread(_watch, ())
def _run():
    with open("main.py", "rb") as f:
        source = f.read()
    code = compile(source, "main.py", "exec", dont_inherit=True)
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    exec(code, main.__dict__)
try:
    _run()
except SystemExit:
    raise
except BaseException as e:
    import traceback
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
    sys.stderr.flush()
    os._exit(1)
"""
_BWRAP_ERROR = b"bwrap: "  # how bubblewrap's own failures begin (before the code runs)


class CodeInterpreter:
    """Runs Python code in a sandboxed, limited child process; :meth:`run` never raises for
    anything the code does. Thread-safe: the tool pool calls it from many threads.

    ``site_packages``: the top-level packages the code may import (e.g. ``("numpy",
    "sympy", "mpmath")``), bound read-only into the sandbox. ``sandboxed=False`` runs
    without the sandbox (then any ``site_packages`` makes every package of the trainer's
    Python importable). Raises :class:`~mindspeed_rl.agent_tools.sandbox.SandboxUnavailable`
    when the sandbox cannot be built here: there is no silent fallback.
    """

    def __init__(self, timeout_s: float, memory_limit_mb: int, *, site_packages=(),
                 sandboxed: bool = True, max_output_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.max_output_bytes = max_output_bytes
        self.sandbox = Sandbox.build(site_packages) if sandboxed else None
        self._flags = ["-I", "-B", "-u"] if site_packages and not sandboxed else \
            ["-I", "-S", "-B", "-u"]
        self._live: set[subprocess.Popen] = set()   # started, not reaped
        self._dying: set[subprocess.Popen] = set()  # killed, not reaped yet
        self._closing = False
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec) -> "CodeInterpreter":
        if spec.unsafe_no_sandbox:
            warn_unsandboxed(spec.name)
        return cls(spec.default_timeout, spec.memory_limit_mb, site_packages=spec.site_packages,
                   sandboxed=not spec.unsafe_no_sandbox)

    def _limits(self) -> str:
        """The child's limits, ``NAME=soft:hard`` for the start-up code."""
        cpu = math.ceil(self.timeout_s) + 1
        limits = {"CPU": (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard
                  "AS": (self.memory_limit_mb << 20,) * 2,
                  "FSIZE": (FILE_SIZE_LIMIT,) * 2, "CORE": (0, 0),
                  "NOFILE": (OPEN_FILES_LIMIT,) * 2}
        if self.sandbox is None:  # in the sandbox no process can start one (seccomp)
            limits["NPROC"] = (_tasks_now() + SPARE_PROCESSES,) * 2
        return ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in limits.items())

    def run(self, code: str, started: float | None = None) -> ToolResult:
        """Run ``code``; its output (stdout, then stderr) and how it ended.

        The time limit counts from ``started`` (``time.monotonic()``; default: now), the
        moment the caller dispatched the call, so the interpreter's start-up is inside it.
        """
        started = time.monotonic() if started is None else started
        deadline = started + self.timeout_s
        proc, workdir = None, None
        source = code.encode("utf-8", errors="surrogatepass")
        try:
            if self.sandbox is None:
                workdir = tempfile.mkdtemp(prefix="msrl-tool-")
            proc = self._start(workdir)
            _send(proc, len(source).to_bytes(8, "big") + source, deadline)
        except OSError as e:  # a problem of this machine, not of the code: it never ran
            if proc is not None:
                self._end(proc, "killed")
            if workdir is not None:
                _remove(workdir)
            return ToolResult.failed(f"Error: the interpreter could not start ({e})",
                                     time.monotonic() - started)
        how = "killed"
        try:
            how, out, err = _collect(proc, deadline, self.max_output_bytes)
        finally:
            self._end(proc, how)
            if workdir is not None:
                _remove(workdir)
        self.reap(0)  # the children of earlier calls that have finished dying since
        return self._result(how, proc.returncode, out, err, time.monotonic() - started)

    def kill_all(self) -> None:
        """Kill the process group of every call in flight, and of every call that starts
        from now on (the pool is closing)."""
        with self._lock:
            self._closing = True
            live = list(self._live)
        for proc in live:
            _kill_group(proc)

    def reap(self, timeout: float | None = None) -> int:
        """Wait up to ``timeout`` s (None: until done) for the killed children to finish
        dying and reap them; the number still dying."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            dying = list(self._dying)
        for proc in dying:
            try:
                proc.wait(None if end is None else max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            with self._lock:
                self._dying.discard(proc)
                self._live.discard(proc)
        with self._lock:
            return len(self._dying)

    def _start(self, workdir: str | None) -> subprocess.Popen:
        """The child, started in a new session (its group is killed when the call ends).
        In the sandbox the child is bwrap, which reads the seccomp program from a pipe."""
        command = [*self._flags, "-c", _BOOT, self._limits()]
        if self.sandbox is None:
            env = dict(_ENV, HOME=workdir, TMPDIR=workdir)
            proc = self._popen([sys.executable, *command], cwd=workdir, env=env)
        else:
            if self.sandbox.site_dir:
                command.append(self.sandbox.site_dir)
            read_end, write_end = os.pipe()
            try:
                os.write(write_end, self.sandbox.seccomp)  # a few hundred bytes: never blocks
                os.close(write_end)
                write_end = None
                proc = self._popen(self.sandbox.argv(read_end) + command, pass_fds=(read_end,),
                                   env=dict(_ENV, HOME=WORKDIR, TMPDIR=WORKDIR))
            finally:
                os.close(read_end)
                if write_end is not None:
                    os.close(write_end)
        with self._lock:
            self._live.add(proc)
            closing = self._closing
        if closing:  # kill_all ran while this call was starting
            _kill_group(proc)
        return proc

    @staticmethod
    def _popen(argv, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                close_fds=True, **kwargs)

    def _end(self, proc: subprocess.Popen, how: str) -> None:
        """Kill what is left of the call's process group and reap the child. A child that
        was killed (timeout, output) may take a while to finish dying on a loaded host:
        it cannot run any more of its code (SIGKILL is pending), so the call does not wait
        for it; :meth:`reap` does, later."""
        _kill_group(proc)  # before the wait: the group id stays ours until the child is reaped
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(None if how == "exited" else 0)  # exited: a zombie, reaped at once
        except subprocess.TimeoutExpired:
            with self._lock:
                self._dying.add(proc)
            return
        with self._lock:
            self._live.discard(proc)

    def _result(self, how: str, returncode: int, out: bytes, err: bytes,
                seconds: float) -> ToolResult:
        text = (out + err).decode("utf-8", errors="replace")
        if how == "timeout":
            return ToolResult.timeout(timeout_text(self.timeout_s, text), seconds)
        if how == "output":
            return ToolResult.failed(f"{text}\nError: the program wrote more than "
                                     f"{self.max_output_bytes} bytes of output and was stopped",
                                     seconds)
        if returncode == 0:
            return ToolResult(text=text, ok=True, timed_out=False, error=False, seconds=seconds)
        if self.sandbox is not None:
            if err.startswith(_BWRAP_ERROR):  # bubblewrap failed before the code ran
                return ToolResult.failed(f"Error: the sandbox could not start "
                                         f"({' '.join(err.decode(errors='replace').split())})",
                                         seconds)
            if returncode > 128:  # bwrap reports a child killed by signal N as 128 + N
                returncode = 128 - returncode
        if returncode > 0:
            return ToolResult.failed(text if text.strip() else
                                     f"Error: the program exited with status {returncode}",
                                     seconds)
        if -returncode == signal.SIGXCPU:
            return ToolResult.timeout(timeout_text(self.timeout_s, text, " (CPU time)"), seconds)
        if -returncode == signal.SIGXFSZ:
            why = f"wrote a file larger than {FILE_SIZE_LIMIT >> 20} MB"
        else:
            why = f"was killed by {_signal_name(-returncode)}"
        return ToolResult.failed(f"{text.rstrip()}\nError: the program {why}".lstrip(), seconds)


def _send(proc: subprocess.Popen, data: bytes, deadline: float) -> None:
    """Write ``data`` to the child's stdin without blocking past ``deadline`` (a child that
    does not read is the call's problem, reported as its timeout, not a stuck thread)."""
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        if not select.select([], [fd], [], remaining)[1]:
            continue
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:  # it died before reading: _collect reports why
            return


def _tasks_now() -> int:
    """Tasks on the machine (/proc/loadavg): at least the user's, whom RLIMIT_NPROC counts."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 4096


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[str, bytes, bytes]:
    """Read the child's output until it exits ("exited"), the deadline passes ("timeout")
    or a stream passes ``cap`` bytes ("output"); then kill its group and drain the pipes."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        pidfd = _pidfd(proc.pid)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        how = None
        try:
            while how is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    how = "timeout"
                elif pidfd is None and _exited(proc.pid):
                    how = "exited"
                else:
                    wait = remaining if pidfd is not None else min(remaining, 0.05)
                    for key, _ in selector.select(wait):
                        if key.fd == pidfd:
                            how = "exited"
                        elif _read(selector, key.fd, buffers[key.fd], cap):
                            how = how or "output"
            _kill_group(proc)  # whatever of the group is left: strays, or all of it
            _drain(buffers, cap)
        finally:
            if pidfd is not None:
                os.close(pidfd)
    out, err = buffers.values()
    return how, bytes(out), bytes(err)


def _read(selector, fd: int, buffer: bytearray, cap: int) -> bool:
    """Read what ``fd`` has into ``buffer`` (at most ``cap`` bytes kept); True when the
    stream passed ``cap``."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    if not chunk:
        selector.unregister(fd)
        return False
    room = max(0, cap - len(buffer))
    buffer += chunk[:room]
    return len(chunk) > room


def _drain(buffers: dict, cap: int) -> None:
    """What is in the pipes now. Not waiting for EOF: the child has exited or was killed,
    so all it wrote is there, and a killed process can take a while to finish dying on
    a loaded host (or may have left the group and hold a pipe open)."""
    for fd, buffer in buffers.items():
        while len(buffer) < cap:
            try:
                chunk = os.read(fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            buffer += chunk[:cap - len(buffer)]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll instead
        return None


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid stays its group's id)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is not None:  # reaped: its pid (the group id) may be another's now
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _remove(workdir: str) -> None:
    """Remove the call's directory, also where the code took permissions away."""
    def fix(function, path, _):
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            function(path)
        except OSError:
            pass
    shutil.rmtree(workdir, onerror=fix)
