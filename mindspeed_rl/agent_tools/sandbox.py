"""The OS sandbox of the local code interpreter: bubblewrap and a seccomp filter.

Each call of the interpreter runs inside ``bwrap`` (bubblewrap, the unprivileged sandbox
of Flatpak) with:

- new user, PID, network, IPC, UTS and (where the kernel has one) cgroup namespaces; uid
  and gid 65534 inside, no capabilities, no further user namespaces (``--disable-userns``);
  a new session (no terminal to push input into); killed with the thread that started it
  (``--die-with-parent``), and with its PID namespace every process the code started;
- a file system of its own: a read-only root holding only the system's shared libraries
  (``/usr/lib*``), the Python runtime (the interpreter, its standard library and
  ``libpython``, under ``/opt/python``: no host path of its shows), the packages the tool
  config allows (``site_packages``, each bound read-only under ``/opt/site``),
  ``/dev/null``, ``/dev/zero`` and ``/dev/urandom``, and a private tmpfs of
  ``TMPFS_BYTES`` at ``/tmp`` (the working directory, the only writable place). No ``/proc`` (so no other process's memory or environment), no project tree,
  no virtualenv, no checkpoints, no other call's files;
- a network namespace with only a loopback device of its own: no route anywhere, not even
  to the host's 127.0.0.1;
- a seccomp filter (compiled by libseccomp through its Python binding, loaded by bwrap
  before the interpreter starts) that refuses the system calls a contained process has
  no use for and that break containment: ptrace, process_vm_readv/writev, mount and the
  new mount API, keyctl, bpf, perf_event_open, namespaces (unshare, setns), module
  loading, kexec, io_uring and the like (Docker's default profile refuses the same), and
  new processes: fork, vfork and clone without CLONE_THREAD fail with EPERM, so threads
  work and subprocess, os.system, multiprocessing and fork bombs do not. clone3 fails
  with ENOSYS (its flags are in memory that seccomp cannot read), which makes the C
  library fall back to clone for threads.

The limits of the call (time, memory, file size) are set by the interpreter's own start-up
code before it reads the model's code (mindspeed_rl.agent_tools.code_interpreter).

Why these parts: bubblewrap and libseccomp are small, widely deployed and maintained
(Flatpak, Docker, systemd use them); a hand-written "check" of the code would be another
thing for a policy trained with RL to find its way around.
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534         # "nobody": not root inside the sandbox
SITE_DIR = "/opt/site"      # where the allowed packages appear inside
RUNTIME_DIR = "/opt/python"  # where the interpreter's installation appears inside
WORKDIR = "/tmp"            # the call's working directory, HOME and TMPDIR
TMPFS_BYTES = 64 << 20      # the only writable place, all files of a call together

# System calls no contained program needs and that break containment (Docker's default
# seccomp profile refuses these too). Names unknown on this architecture are skipped.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    "unshare", "setns",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "vhangup", "uselib",
    "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "personality",
    # no new processes (threads are clone with CLONE_THREAD, below)
    "fork", "vfork",
)
_CLONE_THREAD = 0x00010000


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no bubblewrap, no user namespaces, no seccomp binding,
    a package the tool config allows is not installed); the message says what is missing."""


def _seccomp_binding():
    """libseccomp's Python binding: Debian's python3-seccomp (``seccomp``) or its ctypes
    twin from PyPI (``pyseccomp``, same API)."""
    try:
        import seccomp
        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp
        return pyseccomp
    except (ImportError, OSError) as e:  # OSError: libseccomp.so.2 itself is missing
        raise SandboxUnavailable(
            f"no binding of libseccomp ({e}): pip install pyseccomp (it needs the system's "
            "libseccomp2), or apt-get install python3-seccomp") from None


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The compiled filter (classic BPF, as ``seccomp_export_bpf`` writes it) that bwrap
    loads before it starts the interpreter (``--seccomp FD``)."""
    sc = _seccomp_binding()
    refuse = sc.ERRNO(errno.EPERM)
    program = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            program.add_rule(refuse, name)
        except (OSError, RuntimeError, ValueError):  # not a system call of this architecture
            continue
    # clone: threads (CLONE_THREAD set) only. flags are argument 0 on x86_64 and arm64.
    program.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
    program.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as f:
        program.export_bpf(f)
        f.seek(0)
        return f.read()


def package_binds(names) -> list[tuple[str, str]]:
    """(host path, path inside) of each allowed top-level package (or module), and of the
    shared libraries its wheel bundles beside it (``numpy.libs``), found as the trainer's
    Python would import them, without importing them."""
    binds = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or (spec.origin is None and not spec.submodule_search_locations):
            raise SandboxUnavailable(
                f"site_packages: {name!r} is not installed for the trainer's Python "
                f"({sys.executable}); install it, or remove it from the tool config")
        if spec.submodule_search_locations:  # a package: its folder
            locations = list(spec.submodule_search_locations)
            if len(locations) != 1:
                raise SandboxUnavailable(f"site_packages: {name!r} is a namespace package "
                                         f"spread over {locations}; list its parts instead")
            host = locations[0]
        else:                                 # a module: its file
            host = spec.origin
        binds.append((host, f"{SITE_DIR}/{Path(host).name}"))
        bundled = Path(host).parent / f"{name}.libs"
        if bundled.is_dir():
            binds.append((str(bundled), f"{SITE_DIR}/{bundled.name}"))
    return binds


def _runtime_binds() -> tuple[str, list[tuple[str, str]], dict[str, str]]:
    """The interpreter (the real one behind a virtualenv) and what it needs to start: its
    standard library and libpython; the interpreter's path inside and the environment it
    needs there. The files under the interpreter's installation prefix appear under
    ``RUNTIME_DIR`` at the same relative paths (Python finds its standard library from
    where the executable lies), so no path of the host's, which may be inside the project
    tree or a home directory, shows inside; libpython is then found through
    ``LD_LIBRARY_PATH``. A file outside the prefix keeps its own path."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)

    def inside(path: str) -> str:
        rel = os.path.relpath(path, prefix)
        return path if rel == ".." or rel.startswith("../") else f"{RUNTIME_DIR}/{rel}"

    binds = {executable: inside(executable)}
    # the installation's own folders, not a virtualenv's: sysconfig puts "platstdlib"
    # under sys.exec_prefix, which in a virtualenv is the virtualenv
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
    for key in ("stdlib", "platstdlib"):
        path = os.path.realpath(paths[key])
        binds[path] = inside(path)
    env = {}
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        if libdir and soname and os.path.exists(os.path.join(libdir, soname)):
            real = os.path.realpath(os.path.join(libdir, soname))
            binds[real] = os.path.join(os.path.dirname(inside(real)), soname)
            env["LD_LIBRARY_PATH"] = os.path.dirname(inside(real))
    return binds[executable], sorted(binds.items()), env


def _system_binds() -> list[list[str]]:
    """The shared libraries of the system: /usr/lib* read-only; /lib, /lib64... as the host
    has them (symlinks into /usr on merged-/usr systems, folders elsewhere)."""
    args = []
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32"):
        if os.path.isdir(path) and not os.path.islink(path):
            args.append(["--ro-bind", path, path])
    for path in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(path):
            args.append(["--symlink", os.readlink(path), path])
        elif os.path.isdir(path):
            args.append(["--ro-bind", path, path])
    if os.path.isfile("/etc/ld.so.cache"):  # the dynamic loader's index of the libraries
        args.append(["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"])
    return args


@dataclass(frozen=True)
class Sandbox:
    """How to start the interpreter inside bubblewrap: ``argv(seccomp_fd)`` is the
    command line up to the interpreter; the caller appends its arguments."""

    bwrap: str
    python: str
    bind_args: tuple[str, ...]
    seccomp: bytes
    tmpfs_bytes: int = TMPFS_BYTES

    @classmethod
    def build(cls, site_packages=()) -> "Sandbox":
        """The sandbox for a tool that may import ``site_packages``; raises
        :class:`SandboxUnavailable` when a part is missing (checked once more by running
        it: :func:`mindspeed_rl.agent_tools.preflight.sandbox_problem`)."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed or not on PATH")
        python, runtime, env = _runtime_binds()
        args = [a for group in _system_binds() for a in group]
        for host, inside in runtime + package_binds(site_packages):
            args += ["--ro-bind", host, inside]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return cls(bwrap=bwrap, python=python, bind_args=tuple(args),
                   seccomp=seccomp_program())

    @property
    def site_dir(self) -> str | None:
        return SITE_DIR if any(a.startswith(SITE_DIR + "/") for a in self.bind_args) else None

    def argv(self, seccomp_fd: int) -> list[str]:
        return [
            self.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            *self.bind_args,
            "--dev-bind", "/dev/null", "/dev/null", "--dev-bind", "/dev/zero", "/dev/zero",
            "--dev-bind", "/dev/urandom", "/dev/urandom",
            "--size", str(self.tmpfs_bytes), "--tmpfs", WORKDIR, "--chdir", WORKDIR,
            # the root (bwrap's own tmpfs, owned by the sandbox's user) read-only last: the
            # sized /tmp stays the only place the code can write
            "--remount-ro", "/",
            "--seccomp", str(seccomp_fd),
            self.python,
        ]


_WARNED_UNSANDBOXED = False


def warn_unsandboxed(tool_name: str) -> None:
    """The warning of ``unsafe_no_sandbox: true``: once per process, on rank 0 only (every
    rank of a run checks its config), so once per run."""
    global _WARNED_UNSANDBOXED
    if _WARNED_UNSANDBOXED:
        return
    _WARNED_UNSANDBOXED = True
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: tool {tool_name!r} runs the model's code WITHOUT a sandbox "
              "(unsafe_no_sandbox: true): the code can read and write whatever the trainer's "
              "user can, reach the network and outlive its call (docs/tools.md)",
              file=sys.stderr, flush=True)
