"""Run an untrusted program in a confined child process.

Model-written code is hostile input: it may loop, allocate without end, fork without
end, write over the project, read the trainer's secrets, open sockets or signal the
trainer. :func:`run_sandboxed` runs one program (an argv) with:

==================  ==========================================================================
what                how (``namespaces`` mode; ``basic`` mode where the kernel has no
                    unprivileged user namespaces, e.g. some hardened distributions)
==================  ==========================================================================
CPU time            RLIMIT_CPU (SIGKILL; basic: SIGXCPU, then SIGKILL one second later)
wall time           the parent kills the sandbox's pid 1 (hence every process in it)
memory              RLIMIT_AS (address space): allocations fail, Python raises MemoryError
file size           RLIMIT_FSIZE per file; the working directory is a tmpfs of bounded size
process count       max_processes=1 (the default): a seccomp filter fails every new process
                    (fork, vfork, clone without CLONE_THREAD) with EAGAIN; threads stay
                    allowed. Above 1: RLIMIT_NPROC, counted within the sandbox's own user
                    namespace (basic: over all the user's processes); the kernel exempts a
                    real root user from it, so as root only the pid namespace (every process
                    dies with the run) bounds them
network             a new network namespace with no interface up, and a seccomp filter that
                    fails socket/socketpair/io_uring_setup with EPERM (both modes)
filesystem          a root of its own (pivot_root): only the interpreter's prefixes and
                    libraries, /usr, /bin, /lib*, /etc/ld.so.cache, the program and what the
                    caller exposes, bound read-only, a few /dev nodes and a private tmpfs as
                    working directory; the host's /etc, home directories, the project and
                    /tmp do not exist there (:func:`interpreter_paths`, :func:`root_entries`).
                    basic: cwd in a temporary directory, the host's files stay readable and
                    files writable by the user stay so
other processes     a new pid namespace and its own /proc: nothing outside is visible or
                    signalable; ptrace and process_vm_* fail (seccomp, both modes). basic:
                    every signal-sending call fails (seccomp), but /proc/PID of the user's
                    processes stays readable
environment         empty but for PATH, LANG, HOME and thread counts (both modes); the
                    interpreter runs with ``-I`` (no PYTHONPATH, no user site)
credential files    not in the root; ``~/.ssh``, ``~/.aws``, ``~/.netrc`` ... (see
                    ``CREDENTIAL_PATHS``) inside an exposed path are covered by empty ones.
                    basic: readable
privileges          every capability dropped, no_new_privs (both modes)
==================  ==========================================================================

``basic`` mode is a named, logged degradation (one warning per process listing what it
does not enforce; the code scorer also counts it in every sample's metrics), never a
silent one. The working directory is removed afterwards.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import logging
import marshal
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from verl_megatron.reward import sandbox_boot

logger = logging.getLogger(__name__)

NAMESPACES, BASIC = "namespaces", "basic"
ISOLATION_MODES = ("auto", NAMESPACES, BASIC)
BASIC_MODE_GAPS = (
    "files writable by this user stay writable (its processes' /proc/PID/mem included)",
    "/proc/PID of this user's processes (their environment) stays readable",
    "above max_processes=1 the process count is shared with this user's processes",
    "credential files in the home directory stay readable",
    "the host's files (/etc, home directories, the project) stay readable",
)
# Where credentials usually live, relative to the home directory: hidden (namespaces mode).
CREDENTIAL_PATHS = (
    ".ssh",
    ".aws",
    ".azure",
    ".config/gcloud",
    ".config/gh",
    ".kube",
    ".docker",
    ".gnupg",
    ".netrc",
    ".git-credentials",
    ".pypirc",
    ".cache/huggingface",
    ".huggingface",
)
# What every sandbox's root holds besides the interpreter's own prefixes (namespaces mode):
# the system's programs and shared libraries and the dynamic loader's index, but not /etc.
SYSTEM_PATHS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache")
# Causes of a run's end (SandboxResult.cause).
EXITED, TIMEOUT, CPU_LIMIT, KILLED, OUTPUT_LIMIT, SANDBOX_ERROR = (
    "exited",
    "timeout",
    "cpu_limit",
    "killed",
    "output_limit",
    "sandbox_error",
)
_SETUP_MARKER = b"sandbox setup failed"
# Threads a program may start beyond max_processes (RLIMIT_NPROC counts threads): Python
# solutions commonly run main() in a thread with a big stack to recurse deeply.
THREAD_SLACK = 16
_READ_CHUNK = 65536


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        cpu_s: CPU seconds for the whole run, rounded up to whole seconds.
        wall_s: wall-clock seconds, start-up included; then every process in it is killed.
        memory_mb: address space of each process (RLIMIT_AS), in MiB.
        file_size_mb: the largest file a process may write, in MiB; the private working
            directory holds at most four times this.
        max_processes: processes the program may have at once, itself included (1: it
            cannot start any); threads count too, beyond ``THREAD_SLACK`` of them.
        max_output_bytes: stdout (and, separately, stderr) read back; past it the run is
            killed and ends as ``output_limit``.
        open_files: file descriptors per process (RLIMIT_NOFILE).
    """

    cpu_s: float = 10.0
    wall_s: float = 15.0
    memory_mb: int = 1024
    file_size_mb: int = 32
    max_processes: int = 1
    max_output_bytes: int = 8 << 20
    open_files: int = 64

    def __post_init__(self) -> None:
        names = ("cpu_s", "wall_s", "memory_mb", "file_size_mb", "max_processes", "max_output_bytes")
        require_positive(self, names, "SandboxLimits")


def require_positive(owner: object, names: Iterable[str], where: str) -> None:
    """Raise ValueError naming ``{where}.{name}`` for the first of ``names`` on ``owner`` that is
    not a positive number."""
    for name in names:
        value = getattr(owner, name)
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{where}.{name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """How a sandboxed run ended.

    ``cause``: "exited" (``returncode`` is its exit code), "timeout" (wall time), "cpu_limit",
    "killed" (ended by signal ``-returncode``: a crash, or the memory limit hit outside
    Python's allocator), "output_limit" or "sandbox_error" (the sandbox itself could not be
    set up; ``stderr`` says why).
    """

    cause: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    cpu_s: float
    wall_s: float
    mode: str


def _program_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _same_user_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                count += os.stat(f"/proc/{entry}").st_uid == uid
    return count


def _rlimits(limits: SandboxLimits, mode: str) -> dict[str, list[int]]:
    cpu = max(1, math.ceil(limits.cpu_s))
    memory = limits.memory_mb << 20
    file_size = limits.file_size_mb << 20
    # namespaces: the count is per user namespace, and the boot process is in it too.
    extra = limits.max_processes + THREAD_SLACK
    procs = extra + 1 if mode == NAMESPACES else _same_user_processes() + extra
    return {
        # pid 1 of a namespace ignores SIGXCPU: there the hard limit (SIGKILL) is the limit.
        "RLIMIT_CPU": [cpu, cpu if mode == NAMESPACES else cpu + 1],
        "RLIMIT_AS": [memory, memory],
        "RLIMIT_FSIZE": [file_size, file_size],
        "RLIMIT_NPROC": [procs, procs],
        "RLIMIT_NOFILE": [limits.open_files, limits.open_files],
        "RLIMIT_CORE": [0, 0],
    }


@functools.cache
def detect_isolation() -> str:
    """``namespaces`` if a trial sandbox can set them up here, else ``basic`` (logged once)."""
    if os.uname().machine not in sandbox_boot.SECCOMP_ARCHES:
        _warn(
            f"code sandbox: no seccomp filter for {os.uname().machine}: sockets, ptrace and new "
            "processes are not refused by seccomp (namespaces mode still has no network and no "
            "other process in sight)"
        )
    argv = [sys.executable, "-I", "-S", "-c", "pass"]
    probe = _run(argv, b"", SandboxLimits(cpu_s=5, wall_s=30), NAMESPACES, credential_paths())
    if probe.cause == EXITED and probe.returncode == 0:
        return NAMESPACES
    reason = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or [probe.cause]
    message = (
        f"code sandbox: user namespaces unavailable ({reason[0]}); running in 'basic' mode "
        f"(rlimits, seccomp socket block, empty environment, temporary cwd); not enforced: "
        f"{'; '.join(BASIC_MODE_GAPS)}"
    )
    _warn(message)
    return BASIC


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def credential_paths() -> list[str]:
    """The existing ``CREDENTIAL_PATHS`` of this user's home directory."""
    home = os.path.expanduser("~")
    return [path for path in (os.path.join(home, p) for p in CREDENTIAL_PATHS) if os.path.lexists(path)]


@functools.cache
def interpreter_paths() -> tuple[str, ...]:
    """What this interpreter needs to start and import its libraries: ``SYSTEM_PATHS`` (the
    ELF interpreter and the shared libraries live there), ``sys.executable``, the prefixes of
    the environment and of the base installation, and sysconfig's library paths."""
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    prefixes = (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)
    found = [*SYSTEM_PATHS, sys.executable, *prefixes, *(sysconfig.get_path(n) for n in names)]
    return tuple(p for p in dict.fromkeys(os.path.abspath(p) for p in found if p) if os.path.lexists(p))


def root_entries(paths: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """The sandbox root's read-only binds (real paths, no symlink on the way) and symlinks
    (path -> target, as on the host) that make each of ``paths`` resolve there as it does here;
    a symlink's target is followed the same way. Missing paths are left out."""
    binds: dict[str, None] = {}
    links: dict[str, str] = {}
    pending = [os.path.abspath(p) for p in paths]
    while pending:
        path = pending.pop()
        if not os.path.lexists(path) or "\n" in path:
            continue
        resolved = "/"
        for part in path.strip("/").split("/"):
            candidate = os.path.join(resolved, part)
            if os.path.islink(candidate):
                if candidate not in links:
                    links[candidate] = os.readlink(candidate)
                    pending.append(os.path.join(os.path.dirname(candidate), links[candidate]))
                resolved = os.path.realpath(candidate)
            else:
                resolved = candidate
        binds[resolved] = None
    return list(binds), links


def run_sandboxed(
    argv: Sequence[str],
    stdin: bytes = b"",
    limits: SandboxLimits | None = None,
    isolation: str = "auto",
    hide: Sequence[str] | None = None,
    expose: Sequence[str] = (),
) -> SandboxResult:
    """Run ``argv`` (an absolute executable path first) confined, feeding it ``stdin``.

    ``isolation``: "auto" (namespaces where available, else basic, logged), "namespaces"
    (a failure to set them up ends as ``sandbox_error``) or "basic". In namespaces mode the
    program's filesystem holds only :func:`interpreter_paths`, ``argv[0]`` and ``expose``
    (read-only, at their own paths) and its private working directory. ``hide``: paths
    under those covered by empty ones (default: :func:`credential_paths`).
    """
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"run_sandboxed: isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
    mode = detect_isolation() if isolation == "auto" else isolation
    hidden = credential_paths() if hide is None else list(hide)
    return _run(list(argv), stdin, limits or SandboxLimits(), mode, hidden, expose)


def _run(
    argv: list[str],
    stdin: bytes,
    limits: SandboxLimits,
    mode: str,
    hidden: Sequence[str] = (),
    expose: Sequence[str] = (),
) -> SandboxResult:
    binds, links = root_entries([*interpreter_paths(), argv[0], *expose]) if mode == NAMESPACES else ([], {})
    workdir = tempfile.mkdtemp(prefix="verl-sandbox-")
    status_read, status_write = os.pipe()
    code_fd = _boot_bytecode(sandbox_boot.__file__)
    config = [
        f"namespaces={int(mode == NAMESPACES)}",
        f"no_fork={int(limits.max_processes == 1)}",
        f"workdir={workdir}",
        f"wall_s={limits.wall_s}",
        f"tmpfs_bytes={4 * (limits.file_size_mb << 20)}",
        f"status_fd={status_write}",
        f"caller={os.getpid()}",
        *(f"rlimit:{name}={soft},{hard}" for name, (soft, hard) in _rlimits(limits, mode).items()),
        *(f"env:{name}={value}" for name, value in _program_env(workdir).items()),
        *(f"hide={os.path.realpath(path)}" for path in hidden),
        *(f"bind={path}" for path in binds),
        *(f"link={path}\n{target}" for path, target in links.items()),
        *([] if code_fd is None else [f"code_fd={code_fd}"]),
    ]
    boot = sandbox_boot.__file__ if code_fd is None else f"/proc/self/fd/{code_fd}"
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", boot, *config, "--", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd=workdir,
            pass_fds=(status_write,) if code_fd is None else (status_write, code_fd),
            start_new_session=True,  # its own process group: the trainer's Ctrl-C is not its
        )
    except BaseException:
        os.close(status_read)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        os.close(status_write)
    try:
        return _supervise(proc, status_read, stdin, limits, start, mode)
    finally:
        _kill(proc, None)
        proc.wait()
        os.close(status_read)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()
        shutil.rmtree(workdir, ignore_errors=True)


# path -> (pid, fd, (st_dev, st_ino)) of the boot's bytecode made in process pid.
_BOOT_CODE: dict[str, tuple[int, int, tuple[int, int]]] = {}


def _boot_bytecode(path: str) -> int | None:
    """A sealed (unwritable) in-memory .pyc of the boot script at ``path``, compiled once per
    process: run from its source, every boot compiled its ~500 lines again (about 4 ms of CPU
    a sample). None where the kernel has no sealed memfds or no /proc: the boot then runs its
    source. Two threads' first runs may each make one; one fd of the two is kept open unused.
    A forked child makes its own, and so does a process whose fd was closed since (a worker
    closes what it inherited): a number from the cache is used only while it still names the
    file it was made as, never a file that later took the number."""
    cached = _BOOT_CODE.get(path)
    if cached is not None and cached[0] == os.getpid():
        with contextlib.suppress(OSError):
            st = os.fstat(cached[1])
            if (st.st_dev, st.st_ino) == cached[2]:
                return cached[1]
    fd = _new_boot_bytecode(path)
    if fd is not None:
        st = os.fstat(fd)
        _BOOT_CODE[path] = (os.getpid(), fd, (st.st_dev, st.st_ino))
    return fd


def _new_boot_bytecode(path: str) -> int | None:
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True, optimize=0)
    # The interpreter runs a file that starts with its magic number as a .pyc and skips the
    # rest of the 16-byte header (flags, source mtime and size: unused here).
    data = memoryview(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))
    try:
        fd = os.memfd_create("sandbox_boot.pyc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return None
    while data:
        data = data[os.write(fd, data) :]
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _kill(proc: subprocess.Popen, child_pid: int | None) -> None:
    """SIGKILL the program (in namespaces mode its pid 1: the kernel then ends every process
    in the namespace) and the boot process's group. The boot reaps the program before it
    exits, so while the boot is not reaped by us the program's pid cannot be reused."""
    if proc.poll() is not None:
        return
    if child_pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child_pid, signal.SIGKILL)  # basic mode: its session/process group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child_pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _supervise(
    proc: subprocess.Popen, status_fd: int, stdin: bytes, limits: SandboxLimits, start: float, mode: str
) -> SandboxResult:
    """Feed stdin, read stdout/stderr (capped) and the status pipe until the run ends or
    its wall time is up."""
    deadline = start + limits.wall_s
    out, err, status = bytearray(), bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    pending = memoryview(stdin)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(status_fd, selectors.EVENT_READ, status)
    child_pid = None
    cause = None
    while sel.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            cause = TIMEOUT
            break
        for key, _ in sel.select(remaining):
            if key.fileobj is proc.stdin:
                try:
                    written = os.write(proc.stdin.fileno(), pending[:_READ_CHUNK])
                except BlockingIOError:
                    written = 0  # the pipe is full for now
                except OSError:  # the program closed its stdin: the rest is not wanted
                    written = len(pending)
                pending = pending[written:]
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
            chunk = os.read(fd, _READ_CHUNK)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            key.data.extend(chunk)
            if child_pid is None and key.data is status and b"\n" in status:
                first = status.split(b"\n", 1)[0].split()
                if first[:1] == [b"pid"]:
                    child_pid = int(first[1])
            if key.data is not status and len(key.data) > limits.max_output_bytes:
                cause = OUTPUT_LIMIT
                break
        if cause is not None:
            break
    sel.close()
    if cause is not None:
        _kill(proc, child_pid)
    proc.wait()
    wall = time.monotonic() - start
    return _result(
        cause, bytes(out[: limits.max_output_bytes]), bytes(err), bytes(status), limits, wall, mode
    )


def _result(
    cause: str | None, out: bytes, err: bytes, status: bytes, limits: SandboxLimits, wall: float, mode: str
) -> SandboxResult:
    exit_line = next((line.split() for line in status.splitlines() if line.startswith(b"exit ")), None)
    setup_line = next((line for line in status.splitlines() if line.startswith(b"setup ")), None)
    cpu = float(exit_line[2]) if exit_line else 0.0
    if cause is None and exit_line is not None and exit_line[3:] == [b"wall"]:
        cause = TIMEOUT  # the boot's own wall-clock limit (just after ours) ended it
    if cause is not None:
        return SandboxResult(cause, None, out, err, cpu, wall, mode)
    if exit_line is None:
        message = setup_line.decode(errors="replace") if setup_line else "the sandbox ended without a status"
        return SandboxResult(SANDBOX_ERROR, None, out, err + message.encode(), cpu, wall, mode)
    wait_status = int(exit_line[1])
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        # The kernel's CPU-limit clock and rusage's differ by a few ticks: a SIGKILL (not
        # ours: that set ``cause``) near the limit is the limit's.
        over_cpu = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= 0.9 * math.ceil(limits.cpu_s))
        return SandboxResult(CPU_LIMIT if over_cpu else KILLED, -sig, out, err, cpu, wall, mode)
    code = os.WEXITSTATUS(wait_status)
    if code == sandbox_boot.SETUP_FAILED_EXIT and _SETUP_MARKER in err:
        return SandboxResult(SANDBOX_ERROR, code, out, err, cpu, wall, mode)
    return SandboxResult(EXITED, code, out, err, cpu, wall, mode)


__all__ = [
    "BASIC",
    "NAMESPACES",
    "SandboxLimits",
    "SandboxResult",
    "detect_isolation",
    "require_positive",
    "run_sandboxed",
]
