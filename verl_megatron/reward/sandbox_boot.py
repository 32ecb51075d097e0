"""The first process of a sandbox: confines itself, then runs the program.

Run by :mod:`verl_megatron.reward.sandbox` as ``python -I -S -B sandbox_boot.py KEY=VALUE...
-- PROGRAM_ARGV...`` (keys: ``namespaces``, ``workdir``, ``tmpfs_bytes``, ``status_fd``,
``no_fork``, ``wall_s``, ``hide``, ``bind`` (a path), ``link`` (``PATH\nTARGET``) (these three repeated),
``env:NAME``, ``rlimit:RLIMIT_X`` = ``soft,hard``, ``code_fd``, ``caller``) with an empty environment, in
a fresh temporary directory, with a status pipe on ``status_fd``; or from its bytecode, compiled
once by the caller, as ``/proc/self/fd/N`` with ``code_fd=N`` (closed first). Standard library only and
few imports (it runs for every sample): it must not import project code.

With ``namespaces`` (the default where the kernel allows unprivileged user namespaces) it
enters new user, mount, network, pid, ipc and uts namespaces, remounts every inherited
mount read-only and stages the sandbox's own root on a tmpfs: only the ``bind`` paths (the
interpreter, its libraries, the program), read-only, the ``link`` symlinks, a few device
nodes, a size-limited tmpfs at the working directory and empty ones over the ``hide``
paths a bind brought in; then forks: the
child is pid 1 of the new pid namespace (it cannot see or signal any process outside,
and every process it starts dies with it), mounts a /proc of its own in the new root
(hiding every process outside), pivots into that root and detaches the host's tree (so
/etc, /home, the project and the rest are not there to read), sets the resource limits,
drops every capability and
execs the program. In every mode the child drops every capability and gets ``no_new_privs`` and a seccomp
filter (x86_64 and aarch64) that makes ``socket``/``socketpair``/``io_uring_setup``,
``ptrace``/``process_vm_*`` (and without a pid namespace every signal-sending call) fail
with EPERM and, with ``no_fork``, every new process (fork, vfork, clone without CLONE_THREAD) fail with
EAGAIN while threads stay allowed: RLIMIT_NPROC alone does not bind a process whose real
user is root, even inside a user namespace. The status pipe carries ``pid N`` (the child's pid as
the parent sees it, so the parent can kill the whole namespace) and ``exit STATUS CPU_S``
(``wall`` added when the boot's own wall-clock limit ended the program).

Nothing outlives the caller: the boot gets SIGTERM when its parent dies and the program
SIGKILL when the boot dies (parent-death signals, each checked once set); the boot kills the
program once ``wall_s`` (plus a grace: the caller's limit acts first) is up or its parent is
gone, and then removes the working directory itself if the parent is gone. The caller passes
its pid (``caller``): a caller that died before the boot started is told apart from one alive
(the boot's parent is then already a reaper, and no death signal would come).
"""

from __future__ import annotations

# signal's C core (already loaded at start-up): the signal module wraps it in enums, whose
# import (enum, functools, collections) cost every sample's boot CPU time. Plain ints here.
import _signal as signal
import ctypes
import os
import resource
import struct
import sys
import time

# <linux/sched.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
# <linux/mount.h>
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 0x20, 0x400, 0x800, 0x1000
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 0x4000, 0x40000, 0x200000, 0x1000000
MS_MOVE, MNT_DETACH = 0x2000, 2
# Per-mount options a remount must keep: the kernel locks them on mounts inherited from a
# more privileged namespace and refuses a remount that would clear one.
_KEEP_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
# statvfs f_flag bit -> the mount flag a remount of a bind of it must keep
_STATVFS_KEEP = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}
# Device nodes a program may open, bound from the host's /dev (a read-only mount still lets
# a device take writes: /dev/null swallows them).
DEVICES = ("null", "zero", "full", "random", "urandom")
# <linux/prctl.h>, <linux/seccomp.h>, <linux/filter.h>
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
EPERM, EAGAIN, ENOSYS = 1, 11, 38
CLONE_THREAD = 0x00010000
# arch -> AUDIT_ARCH value and syscall numbers (fork/vfork: none on aarch64)
SECCOMP_ARCHES = {
    "x86_64": {
        "arch": 0xC000003E,
        "socket": (41, 53, 425),  # socket, socketpair, io_uring_setup
        "trace": (101, 310, 311),  # ptrace, process_vm_readv, process_vm_writev
        "kill": (62, 200, 234, 129, 297, 424),  # kill, tkill, tgkill, rt_(tg)sigqueueinfo, pidfd_send_signal
        "fork": (57, 58),
        "clone": 56,
        "clone3": 435,
        "pivot_root": 155,
    },
    "aarch64": {
        "arch": 0xC00000B7,
        "socket": (198, 199, 425),
        "trace": (117, 270, 271),
        "kill": (129, 130, 131, 138, 240, 424),
        "fork": (),
        "clone": 220,
        "clone3": 435,
        "pivot_root": 41,
    },
}
_X32_SYSCALL_BIT = 0x40000000
SETUP_FAILED_EXIT = 97  # the boot's own failure, told apart from the program's exit codes
# The caller's own wall-clock limit acts first; the boot's is for a caller that is gone.
_WALL_GRACE_S = 0.5
_WAKE_SIGNALS = {signal.SIGCHLD, signal.SIGTERM}

_libc = ctypes.CDLL(None, use_errno=True)


class _IgnoreOSError:
    """``contextlib.suppress(OSError)`` without importing contextlib (and functools and
    collections with it), which cost every sample's boot CPU time."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, traceback) -> bool:
        return kind is not None and issubclass(kind, OSError)


_IGNORE_OSERROR = _IgnoreOSError()


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount, parents before children."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
            keep = sum(_KEEP_FLAGS.get(opt, 0) for opt in fields[5].split(","))
            found.append((point, keep))
    return found


def enter_namespaces() -> None:
    """New user, mount, network, pid, ipc and uts namespaces; every inherited mount read-only."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc.unshare(flags), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Every bind below copies its source mount's flags: read-only from here on.
    for point, keep in _mounts():
        if point == "/proc" or point.startswith("/proc/"):
            continue  # the sandbox gets a /proc of its own
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            # A mount hidden under another one cannot be reached by path (and so cannot be
            # written either); any other mount left writable is a failure.
            if os.path.ismount(point) and _is_writable_mount(point):
                raise


def build_root(
    root: str, workdir: str, tmpfs_bytes: int, binds: list[str], links: dict[str, str], hidden: list[str]
) -> None:
    """The sandbox's own root, staged at ``root`` (a tmpfs): each of ``binds`` (real paths, no
    symlink in them) bound read-only at its own path, each of ``links`` (path -> target) a
    symlink, a few device nodes, a mount point for /proc, a size-limited tmpfs at ``workdir``
    and empty ones over the ``hidden`` paths that a bind brought in. Nothing else of the
    host's tree (/etc, /home, the project, other processes' /proc) exists in it."""
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    kept = [p for p in sorted(set(binds)) if not _under(p, binds)]
    for path, target in sorted(links.items()):
        if not _under(path, kept) and _inside(root, os.path.dirname(path)):
            os.makedirs(root + os.path.dirname(path), exist_ok=True)
            os.symlink(target, root + path)
    for path in kept:
        if _inside(root, path):
            _bind_read_only(path, root + path)
    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            _bind_read_only("/dev/" + name, f"{root}/dev/{name}")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        if not os.path.lexists(f"{root}/dev/{name}"):
            os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", exist_ok=True)
    os.makedirs(root + workdir, exist_ok=True)
    _mount("tmpfs", root + workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=0700")
    for path in (p for p in hidden if _inside(root, p)):
        target = root + path
        if os.path.isdir(target):  # an empty read-only directory over it
            _mount(
                "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k,mode=0500"
            )
        elif os.path.lexists(target) and not os.path.islink(target):  # an empty file over it
            _mount("/dev/null", target, None, MS_BIND)
    _mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _under(path: str, parents: list[str]) -> bool:
    """Whether a strict ancestor of ``path`` is in ``parents``."""
    return any(path.startswith(p.rstrip("/") + "/") for p in parents if p != path)


def _inside(root: str, path: str) -> bool:
    """Whether ``root + path`` stays in ``root`` (no symlink made there leads out)."""
    return os.path.realpath(root + path).startswith(root.rstrip("/") + "/") or path == "/"


def _bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()  # a mount point for a file
    _mount(source, target, None, MS_BIND | MS_REC)
    keep = sum(flag for st, flag in _STATVFS_KEEP.items() if os.statvfs(target).f_flag & st)
    try:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
    except OSError:
        if _is_writable_mount(target):
            raise


def pivot_into(root: str) -> None:
    """Make ``root`` the root directory and drop the host's tree from this mount namespace
    (pivot_root; where the kernel refuses it, e.g. a root that is not a mount point, the
    root is moved over / and chrooted into, as switch_root does)."""
    os.chdir(root)
    nr = SECCOMP_ARCHES.get(os.uname().machine, {}).get("pivot_root")
    if nr is not None and _libc.syscall(nr, b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "umount the host's root")
    else:
        _mount(root, "/", None, MS_MOVE)
        _check(_libc.chroot(b"."), "chroot")
    os.chdir("/")


def _is_writable_mount(point: str) -> bool:
    statvfs = os.statvfs(point)
    return not statvfs.f_flag & os.ST_RDONLY


def mount_own_proc(target: str) -> None:
    """A /proc for the new pid namespace at ``target`` (mounted while the host's /proc is still
    in this mount namespace: the kernel allows a new one only then); where the kernel refuses
    one, an empty read-only tmpfs, so no process outside is visible either way."""
    try:
        _mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")


def drop_capabilities() -> None:
    """No capability left, nor any that an exec could bring back (bounding set emptied)."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the last capability the kernel knows (or, unprivileged, none to drop)
    header = struct.pack("II", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two zeroed __user_cap_data_struct
    _check(_libc.capset(ctypes.c_char_p(header), data), "capset")


def _assemble(code: list[tuple]) -> bytes:
    """Classic BPF with symbolic jump targets: ("label", name) marks a place, a jump's
    jt/jf may name one."""
    labels, place = {}, 0
    for ins in code:
        if ins[0] == "label":
            labels[ins[1]] = place
        else:
            place += 1
    out, place = [], 0
    for ins in code:
        if ins[0] == "label":
            continue
        op, jt, jf, k = ins
        jt = labels[jt] - place - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - place - 1 if isinstance(jf, str) else jf
        out.append(struct.pack("HBBI", op, jt, jf, k))
        place += 1
    return b"".join(out)


def install_seccomp(no_fork: bool, no_kill: bool) -> bool:
    """Seccomp filter (see the module docstring); False if this architecture has none here."""
    arch = SECCOMP_ARCHES.get(os.uname().machine)
    if arch is None:
        return False
    code: list[tuple] = [(BPF_LD_W_ABS, 0, 0, 4), (BPF_JEQ_K, 1, 0, arch["arch"])]  # seccomp_data.arch
    code += [(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM)]  # another ABI (i386 socketcall...): refuse
    code += [(BPF_LD_W_ABS, 0, 0, 0)]  # seccomp_data.nr
    if os.uname().machine == "x86_64":
        code += [(BPF_JGE_K, "eperm", 0, _X32_SYSCALL_BIT)]  # x32 ABI: refuse
    refused = arch["socket"] + arch["trace"] + (arch["kill"] if no_kill else ())
    code += [(BPF_JEQ_K, "eperm", 0, nr) for nr in refused]
    if no_fork:
        code += [(BPF_JEQ_K, "eagain", 0, nr) for nr in arch["fork"]]
        code += [(BPF_JEQ_K, "enosys", 0, arch["clone3"])]  # flags behind a pointer: libc falls back to clone
        code += [(BPF_JEQ_K, 0, "allow", arch["clone"]), (BPF_LD_W_ABS, 0, 0, 16)]  # args[0], low half
        code += [(BPF_JSET_K, "allow", "eagain", CLONE_THREAD)]
    code += [("label", "allow"), (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
    code += [("label", "eperm"), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    code += [("label", "eagain"), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EAGAIN)]
    code += [("label", "enosys"), (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    raw = _assemble(code)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxP", len(raw) // 8, ctypes.addressof(buffer))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")
    return True


def set_limits(limits: dict[str, int]) -> None:
    """Soft and hard limits (a hard limit cannot be raised again without privileges)."""
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _child(config: dict, argv: list[str], status_fd: int) -> None:
    os.close(status_fd)
    if config["namespaces"]:
        root = config["workdir"]  # where the root tree was staged
        mount_own_proc(root + "/proc")
        pivot_into(root)
    os.setsid()  # own session: kill(0, ...) reaches nothing outside
    set_limits(config["rlimits"])
    drop_capabilities()
    # Without a pid namespace other processes are visible: no signals at all.
    if not install_seccomp(config["no_fork"], no_kill=not config["namespaces"]):
        os.write(2, b"sandbox: no seccomp filter for this architecture\n")
    os.chdir(config["workdir"])
    os.execve(argv[0], argv, config["env"])


def parse_args(args: list[str]) -> tuple[dict, list[str]]:
    """``KEY=VALUE... -- PROGRAM_ARGV`` -> (config, argv)."""
    split = args.index("--")
    config: dict = {"env": {}, "rlimits": {}, "hide": [], "bind": [], "link": {}}
    for item in args[:split]:
        key, _, value = item.partition("=")
        if key.startswith("env:"):
            config["env"][key[4:]] = value
        elif key.startswith("rlimit:"):
            soft, hard = value.split(",")
            config["rlimits"][key[7:]] = (int(soft), int(hard))
        elif key in ("hide", "bind"):
            config[key].append(value)
        elif key == "link":
            path, _, target = value.partition("\n")
            config["link"][path] = target
        elif key in ("namespaces", "no_fork"):
            config[key] = value == "1"
        elif key in ("tmpfs_bytes", "status_fd", "code_fd", "caller"):
            config[key] = int(value)
        elif key == "wall_s":
            config[key] = float(value)
        else:
            config[key] = value
    return config, args[split + 1 :]


def main() -> None:
    config, argv = parse_args(sys.argv[1:])
    # The caller's pid, not getppid() read here: if the caller died while this interpreter started,
    # getppid() is already the reaper's and the checks below would never see the caller gone.
    parent = config.get("caller", os.getppid())
    if "code_fd" in config:
        os.close(config["code_fd"])  # the boot's own bytecode, already read: not the program's
    status_fd = config["status_fd"]
    try:
        # The host's mount of the working directory's parent, opened before a mount namespace
        # makes every mount read-only: the way to remove the directory if the caller is gone.
        host_tmp = os.open(os.path.dirname(config["workdir"]), os.O_RDONLY | os.O_DIRECTORY)
        if config["namespaces"]:
            enter_namespaces()
            workdir = config["workdir"]
            build_root(
                workdir, workdir, config["tmpfs_bytes"], config["bind"], config["link"], config["hide"]
            )
        # After unshare: entering a user namespace clears the parent-death signal.
        signal.pthread_sigmask(signal.SIG_BLOCK, _WAKE_SIGNALS)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the caller died before the line above
            _remove_workdir(host_tmp, config["workdir"])
            os._exit(SETUP_FAILED_EXIT)
        alive_read, alive_write = os.pipe()
        pid = os.fork()
    except Exception as err:
        os.write(status_fd, f"setup {type(err).__name__}: {err}\n".encode())
        os._exit(SETUP_FAILED_EXIT)
    if pid == 0:
        try:
            os.close(host_tmp)  # the host's writable /tmp: never the program's
            os.close(alive_write)
            _die_with_boot(alive_read)
            _child(config, argv, status_fd)
        except BaseException as err:
            os.write(2, f"sandbox setup failed: {type(err).__name__}: {err}\n".encode())
        os._exit(SETUP_FAILED_EXIT)
    os.close(alive_read)
    os.write(status_fd, f"pid {pid}\n".encode())
    status, over_wall = _wait_program(pid, config["wall_s"] + _WALL_GRACE_S, parent)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    over = " wall" if over_wall else ""
    with _IGNORE_OSERROR:  # the caller may be gone
        os.write(status_fd, f"exit {status} {usage.ru_utime + usage.ru_stime:.4f}{over}\n".encode())
    if os.getppid() != parent:  # nobody left to remove the working directory
        _remove_workdir(host_tmp, config["workdir"])


def _die_with_boot(alive_read: int) -> None:
    """The program gets SIGKILL when the boot process dies (in namespaces mode it is pid 1 of
    its pid namespace: the kernel then ends every process in it). A boot that died before the
    prctl closed the pipe's last write end: the read sees its end."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.set_blocking(alive_read, False)
    try:
        gone = os.read(alive_read, 1) == b""
    except BlockingIOError:
        gone = False
    if gone:
        os._exit(SETUP_FAILED_EXIT)
    os.close(alive_read)


def _wait_program(pid: int, wall_s: float, parent: int) -> tuple[int, bool]:
    """Reap the program; SIGKILL it (and its process group) past ``wall_s`` or once the caller
    is gone (its death signal, SIGTERM, wakes this up as SIGCHLD does). Returns (wait status,
    whether the wall-clock limit ended it)."""
    deadline = time.monotonic() + wall_s
    killed = over_wall = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, over_wall
        remaining = deadline - time.monotonic()
        if not killed and (remaining <= 0 or os.getppid() != parent):
            over_wall = remaining <= 0
            for kill in (os.killpg, os.kill):  # basic mode: its session; namespaces: its pid 1
                with _IGNORE_OSERROR:
                    kill(pid, signal.SIGKILL)
            killed = True
        signal.sigtimedwait(_WAKE_SIGNALS, 1.0 if killed else max(remaining, 0.0))


def _remove_workdir(host_tmp: int, workdir: str) -> None:
    """Remove the (host's) working directory through ``host_tmp``; in namespaces mode the
    sandbox's root is mounted on it here until the program pivots away: detach it first."""
    name = os.path.basename(workdir)
    try:
        _remove_tree(host_tmp, name)
    except OSError:
        _libc.umount2(workdir.encode(), MNT_DETACH)
        with _IGNORE_OSERROR:
            _remove_tree(host_tmp, name)


def _remove_tree(dir_fd: int, name: str) -> None:
    with _IGNORE_OSERROR:
        os.rmdir(name, dir_fd=dir_fd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


if __name__ == "__main__":
    main()
