"""A sandbox outlives no caller: killed with SIGKILL mid-run (a contained worker at its
deadline, a scorer worker on timeout, a crashed trainer), its boot process and program end
within about ``wall_s`` and the working directory is removed, in both isolation modes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import uuid

import psutil
import pytest

from verl_megatron.reward import sandbox


def _run_forever(marker: str, mode: str, wall_s: float, results=None) -> None:
    program = [sys.executable, "-I", "-c", f"import time; time.sleep(600)  # {marker}"]
    result = sandbox.run_sandboxed(program, b"", sandbox.SandboxLimits(cpu_s=2, wall_s=wall_s), mode)
    if results is not None:
        results.put(result.cause)


def _sandbox_processes(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _kill_and_expect_nothing_left(caller, marker: str, workdir: str, label: str) -> None:
    """SIGKILL the caller; within 15 s no sandbox process of ``marker`` runs and ``workdir`` is gone."""
    os.kill(caller.pid, signal.SIGKILL)
    caller.join()
    gone = _wait_for(lambda: not _sandbox_processes(marker) and not os.path.exists(workdir), 15.0)
    left = [(p.pid, p.cmdline()[-1][-60:]) for p in _sandbox_processes(marker)]
    assert gone, f"{label}: processes left {left}, working dir left: {os.path.exists(workdir)}"


def _end(caller, marker: str) -> None:
    """Whatever a failed test left: the caller and every process of ``marker``."""
    if caller.is_alive():
        caller.kill()
        caller.join()
    for proc in _sandbox_processes(marker):
        proc.kill()


@pytest.mark.parametrize("mode", ["namespaces", "basic"])
def test_sandbox_dies_with_its_killed_caller(mode: str) -> None:
    if mode == "namespaces" and sandbox.detect_isolation() != "namespaces":
        mode = "basic"  # the machine has no user namespaces: the basic mode still must hold
    marker = uuid.uuid4().hex
    # wall_s 5 s: longer than a loaded machine takes to start both processes. The working directory
    # goes at the boot's wall limit: in the basic mode it outlived a killed caller by over 10 s
    # with a 60 s limit (the program and boot had ended), seen once in a full suite.
    caller = multiprocessing.get_context("fork").Process(target=_run_forever, args=(marker, mode, 5.0))
    caller.start()
    try:
        # the boot process (its argv names the working directory) and the program, both started
        assert _wait_for(lambda: len(_sandbox_processes(marker)) >= 2, 30.0), _sandbox_processes(marker)
        boot = next(p for p in _sandbox_processes(marker) if "workdir=" in " ".join(p.cmdline()))
        workdir = next(a[len("workdir=") :] for a in boot.cmdline() if a.startswith("workdir="))
        assert os.path.isdir(workdir)
        # wall_s 5 s (+0.5 s grace): generous bound, not a timing measurement
        _kill_and_expect_nothing_left(caller, marker, workdir, mode)
    finally:
        _end(caller, marker)


def test_a_caller_dead_before_the_boot_starts_leaves_nothing(tmp_path, monkeypatch) -> None:
    """The caller dies after starting the boot process but before the boot's own code runs (a
    loaded machine takes a while to start an interpreter): the boot then has a reaper for a
    parent and gets no death signal, so it must know the caller by the pid it was given. It runs
    no program and removes the working directory; before, the program ran to the wall limit and
    the directory stayed for good."""
    from verl_megatron.reward import sandbox_boot

    wrapper = tmp_path / "boot_after_its_caller_died.py"
    wrapper.write_text(
        "import importlib.util, os, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('boot', {sandbox_boot.__file__!r})\n"
        "boot = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(boot)\n"
        # The caller's pid from the boot's arguments, not getppid(): on a loaded machine this
        # interpreter may start after the test has killed the caller already.
        "caller = next(int(a[len('caller='):]) for a in sys.argv if a.startswith('caller='))\n"
        "while os.getppid() == caller:\n"
        "    time.sleep(0.01)\n"
        "boot.main()\n"
    )
    monkeypatch.setattr(sandbox_boot, "__file__", str(wrapper))
    marker = uuid.uuid4().hex
    # wall_s 60 s: far past the wait below, so only the caller's death can end the program
    caller = multiprocessing.get_context("fork").Process(target=_run_forever, args=(marker, "basic", 60.0))
    caller.start()
    try:
        assert _wait_for(lambda: len(_sandbox_processes(marker)) >= 1, 30.0), "the boot did not start"
        boot = _sandbox_processes(marker)[0]
        workdir = next(a[len("workdir=") :] for a in boot.cmdline() if a.startswith("workdir="))
        _kill_and_expect_nothing_left(caller, marker, workdir, "basic, caller dead before the boot")
    finally:
        _end(caller, marker)


def test_sandbox_boot_enforces_the_wall_limit_of_a_stalled_caller() -> None:
    """A caller that stops supervising (SIGSTOP) past ``wall_s``: the boot process kills the
    program itself; the caller, resumed, books it as a timeout."""
    marker = uuid.uuid4().hex
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()
    # wall_s 5 s: longer than a loaded machine takes to start both processes, and within the wait
    caller = ctx.Process(target=_run_forever, args=(marker, "auto", 5.0, results))
    caller.start()
    try:
        assert _wait_for(lambda: len(_sandbox_processes(marker)) >= 2, 30.0), _sandbox_processes(marker)
        os.kill(caller.pid, signal.SIGSTOP)
        program_gone = _wait_for(lambda: len(_sandbox_processes(marker)) <= 1, 15.0)
        left = [(p.pid, p.status()) for p in _sandbox_processes(marker)]
        os.kill(caller.pid, signal.SIGCONT)
        assert program_gone, f"program still running with its caller stopped: {left}"
        assert results.get() == sandbox.TIMEOUT
        caller.join(10.0)
        assert caller.exitcode == 0 and not _sandbox_processes(marker)
    finally:
        if caller.is_alive():
            os.kill(caller.pid, signal.SIGCONT)
            caller.kill()
            caller.join()
        for proc in _sandbox_processes(marker):
            proc.kill()
        results.close()


OPEN_FDS = (
    "import os\n"
    "def is_open(fd):\n"
    "    try:\n"
    "        os.fstat(fd)\n"
    "    except OSError:\n"
    "        return False\n"
    "    return True\n"
    "print([fd for fd in range(64) if is_open(fd)])\n"  # RLIMIT_NOFILE is 64
)


@pytest.mark.parametrize("mode", ["namespaces", "basic"])
def test_program_holds_only_its_standard_streams(mode: str) -> None:
    """The boot's status pipe, its handle on the host's /tmp and its bytecode (compiled once by
    the caller, read from an fd) stay out of the program, first run and later ones alike."""
    if mode == "namespaces" and sandbox.detect_isolation() != "namespaces":
        mode = "basic"
    for _ in range(2):
        run = sandbox.run_sandboxed([sys.executable, "-I", "-S", "-c", OPEN_FDS], isolation=mode)
        assert run.cause == sandbox.EXITED and run.returncode == 0, run
        assert run.stdout == b"[0, 1, 2]\n", run


def test_without_a_memfd_the_boot_runs_its_source(monkeypatch) -> None:
    """Where no sealed memfd can hold the boot's bytecode, the boot runs from its source file."""
    monkeypatch.setattr(sandbox, "_boot_bytecode", lambda path: None)
    run = sandbox.run_sandboxed([sys.executable, "-I", "-S", "-c", OPEN_FDS])
    assert run.cause == sandbox.EXITED and run.returncode == 0, run
    assert run.stdout == b"[0, 1, 2]\n", run


def test_a_closed_bytecode_fd_is_made_again_not_reused() -> None:
    """A worker process closes the fds it inherited, and another file may then take the boot
    bytecode's number: the sandbox must make its bytecode again, never start a boot from
    whatever file now holds that number."""
    print_ok = [sys.executable, "-I", "-S", "-c", "print('ok')"]
    assert sandbox.run_sandboxed(print_ok).stdout == b"ok\n"
    fd = sandbox._boot_bytecode(sandbox.sandbox_boot.__file__)
    if fd is None:  # no sealed memfds here: the boot runs its source, nothing is cached
        return
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    impostor = os.dup2(devnull, fd)  # another file takes the closed number
    os.close(devnull)
    try:
        run = sandbox.run_sandboxed(print_ok)
        assert run.cause == sandbox.EXITED and run.stdout == b"ok\n", run
        fresh = sandbox._boot_bytecode(sandbox.sandbox_boot.__file__)
        assert fresh not in (None, fd), (fresh, fd)
    finally:
        os.close(impostor)
