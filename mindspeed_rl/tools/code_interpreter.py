"""The local code interpreter: the model's Python run in a child process with limits.

Model output is untrusted input and the rank must survive whatever it does, so each
call runs in its own interpreter (``sys.executable -I -S -B -u``: no PYTHON* variables,
no user site, no site-packages unless ``site_packages``, no .pyc, unbuffered output so a
crash loses nothing printed), started in a new session so that the call's whole process
group, grandchildren included, can be killed (SIGKILL) when the call ends, however it
ends. Limits: wall clock (``timeout_s``, from the start of the process), CPU time
(RLIMIT_CPU, the wall limit rounded up + 1 s), address space (RLIMIT_AS =
``memory_limit_mb``), file size (RLIMIT_FSIZE), no core files, a cap on processes
(RLIMIT_NPROC; root is exempt from it by the kernel), and a cap on the output read back
(``max_output_bytes`` per stream; a program past it is stopped). The child gets a fresh
empty working directory (removed afterwards, also its HOME and TMPDIR) and an
environment of a few fixed variables: nothing of the trainer's (tokens, keys) leaks in.

The limits are set by the parent (``prlimit``) on the started child, which waits for a
go byte on stdin before it reads the code: no ``preexec_fn``, which is unsafe in the
threaded trainer. The child keeps its end of that pipe and kills its process group when
the pipe closes, so the calls in flight die with a rank that is killed.

This is a resource sandbox, not a security boundary: the code runs as the trainer's
user, can read what that user can read, open network connections and, by starting a
new session, escape the group kill. docs/tools.md says what to use instead.
"""

from __future__ import annotations

import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mindspeed_rl.tools.result import ToolResult, timeout_text

MAX_OUTPUT_BYTES = 1 << 20
FILE_SIZE_LIMIT = 64 << 20
OPEN_FILES_LIMIT = 256
SPARE_PROCESSES = 256  # processes a call may add (RLIMIT_NPROC counts all of the user's)

_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        # numpy/BLAS in many concurrent calls: one thread each, not one per core each
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Run by the child with -c. Waits for the go byte (its limits are set), points stdin at
# /dev/null, watches the parent's pipe (EOF: the rank is gone: remove the working
# directory the rank cannot remove now, kill the group), then runs main.py as __main__
# and prints a traceback without this wrapper's frames.
_BOOT = r"""
import os, sys, _thread
os.read(0, 1)
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


class CodeInterpreter:
    """Runs Python code in a limited child process; :meth:`run` never raises for
    anything the code does. Thread-safe: the tool pool calls it from many threads."""

    def __init__(self, timeout_s: float, memory_limit_mb: int, *, site_packages: bool = False,
                 max_output_bytes: int = MAX_OUTPUT_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.max_output_bytes = max_output_bytes
        flags = "-I -B -u" if site_packages else "-I -S -B -u"
        self._argv = [sys.executable, *flags.split(), "-c", _BOOT]
        self._live: set[subprocess.Popen] = set()   # started, not reaped
        self._dying: set[subprocess.Popen] = set()  # killed, not reaped yet
        self._closing = False
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec) -> "CodeInterpreter":
        return cls(spec.default_timeout, spec.memory_limit_mb, site_packages=spec.site_packages)

    def run(self, code: str, started: float | None = None) -> ToolResult:
        """Run ``code``; its output (stdout, then stderr) and how it ended.

        The time limit counts from ``started`` (``time.monotonic()``; default: now), the
        moment the caller dispatched the call, so the interpreter's start-up is inside it.
        """
        started = time.monotonic() if started is None else started
        proc, workdir = None, None
        try:
            workdir = tempfile.mkdtemp(prefix="msrl-tool-")
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8",
                      errors="surrogatepass") as f:
                f.write(code)
            proc = self._start(workdir)
            self._limit_and_go(proc)
        except OSError as e:  # a problem of this machine, not of the code: it never ran
            if proc is not None:
                self._end(proc, "killed")
            if workdir is not None:
                _remove(workdir)
            return ToolResult.failed(f"Error: the interpreter could not start ({e})",
                                     time.monotonic() - started)
        how = "killed"
        try:
            how, out, err = _collect(proc, started + self.timeout_s, self.max_output_bytes)
        finally:
            self._end(proc, how)
            _remove(workdir)
        self.reap(0)  # the children of earlier calls that have finished dying since
        return self._result(how, proc.returncode, out + err, time.monotonic() - started)

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

    def _start(self, workdir: str) -> subprocess.Popen:
        env = dict(_ENV, HOME=workdir, TMPDIR=workdir)
        proc = subprocess.Popen(self._argv, cwd=workdir, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
        with self._lock:
            self._live.add(proc)
            closing = self._closing
        if closing:  # kill_all ran while this call was starting
            _kill_group(proc)
        return proc

    def _limit_and_go(self, proc: subprocess.Popen) -> None:
        """Set the child's limits, then let it run the code (it waits for the go byte).
        Raises OSError when a limit cannot be set: the code must not run without them."""
        try:
            _limit(proc.pid, self.timeout_s, self.memory_limit_mb)
            proc.stdin.write(b"g")
            proc.stdin.flush()
        except (ProcessLookupError, BrokenPipeError):  # it died while starting: _collect
            pass                                         # reads why

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

    def _result(self, how: str, returncode: int, output: bytes, seconds: float) -> ToolResult:
        text = output.decode("utf-8", errors="replace")
        if how == "timeout":
            return ToolResult.timeout(timeout_text(self.timeout_s, text), seconds)
        if how == "output":
            return ToolResult.failed(f"{text}\nError: the program wrote more than "
                                     f"{self.max_output_bytes} bytes of output and was stopped",
                                     seconds)
        if returncode == 0:
            return ToolResult(text=text, ok=True, timed_out=False, error=False, seconds=seconds)
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


def _limit(pid: int, timeout_s: float, memory_limit_mb: int) -> None:
    """Set the child's resource limits (before it runs any of the model's code)."""
    cpu = math.ceil(timeout_s) + 1
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard
        resource.RLIMIT_AS: (memory_limit_mb << 20,) * 2,
        resource.RLIMIT_FSIZE: (FILE_SIZE_LIMIT,) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (OPEN_FILES_LIMIT,) * 2,
        resource.RLIMIT_NPROC: (_tasks_now() + SPARE_PROCESSES,) * 2,
    }
    for which, (soft, hard) in limits.items():
        _, current_hard = resource.prlimit(pid, which)
        if current_hard != resource.RLIM_INFINITY:  # never raise a limit: only lower it
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.prlimit(pid, which, (soft, hard))


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
