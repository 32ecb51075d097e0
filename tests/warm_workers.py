"""torchrun workers forked from a warm process: a job's ranks without a fresh interpreter's imports.

A torchrun rank of ``verl_megatron.train`` spends ~8 CPU s importing torch, megatron and
transformers before its first step. Tests that start several 2-rank jobs to watch what the ranks
do (not how an interpreter starts) run this module as torchrun's worker script instead:

    torchrun --nproc_per_node=2 -m tests.warm_workers ARGS   (env VM_WARM_SOCKET=<socket>)

Each worker is a small client (standard library only) that hands its command line, environment,
working folder and stdin/stdout/stderr to a *zygote*, a process that imported the trainer once,
which forks the rank; the rank then runs ``python -m verl_megatron.train ARGS`` as ``__main__``.
``python -m tests.warm_workers -m MODULE ARGS`` runs ``python -m MODULE ARGS`` so (a launch
script's ``$PYTHON``, see ``python_wrapper``).
The client stands for the rank towards torchrun: it forwards the launcher's signals to the rank
and ends as the rank ended (the same exit status, or the same signal). The rank's own pid is what
the job publishes (watchdog records), so a test stops or kills the real process.

The zygote forks a minder per client, and the minder forks the rank: the minder waits for the
rank, reports its status to the client and kills the rank if the client is gone (torchrun killed
it), so no rank outlives its launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

SOCKET_VAR = "VM_WARM_SOCKET"
ENTRY = "verl_megatron.train"
# What a quickstart rank imports on its way to step 1 and its end (the trainer, workers, rollout,
# reward, checkpoint, watchdog, assets, curves): imported once by the zygote, shared by every rank
# it forks (a rank's own run then costs ~2 CPU s instead of ~10).
PRELOAD = (
    "verl_megatron.train",
    "verl_megatron.cli",
    "verl_megatron.trainer.preflight",
    "verl_megatron.trainer.ppo_trainer",
    "verl_megatron.trainer.async_trainer",
    "verl_megatron.trainer.quickstart",
    "verl_megatron.workers.actor",
    "verl_megatron.rollout.native",
    "verl_megatron.rollout.async_worker",
    "verl_megatron.rollout.weight_sync",
    "verl_megatron.models.builder",
    "verl_megatron.reward.managers.naive",
    "verl_megatron.checkpoint.manager",
    "verl_megatron.distributed.watchdog",
    "verl_megatron.trainer.tracking",
    "verl_megatron.trainer.run_dir",
    "verl_megatron.checkpoint.resume",
    "verl_megatron.data.synthetic",
    "verl_megatron.utils.local_assets",
    "verl_megatron.utils.tokenizer",
    "verl_megatron.models.export_io",
    "verl_megatron.planner.command",
    "verl_megatron.reward.model",
    "verl_megatron.workers.lr_schedule",
    "matplotlib.pyplot",
)  # not pyarrow (nor pandas, which imports it): its import starts a thread


@contextlib.contextmanager
def zygote(env: dict[str, str], cwd: str) -> Iterator[str]:
    """A zygote started with ``env`` in ``cwd`` (the repository root); yields the path of its
    socket (the value of VM_WARM_SOCKET) once it listens, and ends it afterwards."""
    with tempfile.TemporaryDirectory(prefix="vm-warm-") as folder:  # short: a socket path has <108 bytes
        path = os.path.join(folder, "zygote.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_workers", "--zygote", path],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            ready = proc.stdout.readline()
            assert ready == b"ready\n", f"the zygote did not start (exit status {proc.wait()})"
            yield path
        finally:
            proc.terminate()  # it waits for its minders, and they for their ranks
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # a rank that never ended: the zygote's whole group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()


def python_wrapper(folder: str, *prefix: str) -> str:
    """An executable ``python`` in ``folder`` whose ``[-u] [PREFIX] -m MODULE ARGS`` runs in a rank
    forked by the zygote named by VM_WARM_SOCKET (started in the repository root); its path. It
    serves a launch script's ``$PYTHON`` and torch's launcher's PYTHON_EXEC, which adds ``-u`` (dropped:
    the forked rank's output is unbuffered already). ``prefix``: arguments put before the caller's
    (``-m tests.warm_script``: the caller's ``SCRIPT ARGS`` run as a script)."""
    path = os.path.join(folder, "python")
    head = " ".join(shlex.quote(arg) for arg in (sys.executable, "-m", "tests.warm_workers", *prefix))
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\n[ "$1" = -u ] && shift\nexec {head} "$@"\n')
    os.chmod(path, 0o755)
    return path


def _zygote(path: str) -> None:
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
    # fork() copies only the calling thread: a thread started by an import would be missing (and
    # its locks held for ever) in every rank.
    assert len(os.listdir("/proc/self/task")) == 1, "the preloaded imports started a thread"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGTERM, _stop)
    print("ready", flush=True)
    with contextlib.suppress(_Stop):
        while True:
            conn, _ = server.accept()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                server.close()
                _mind(conn)
            conn.close()
            _reap(os.WNOHANG)
    # Every minder waited for: their ranks' CPU time is counted in this process's children's, and
    # so in its starter's (a test's measurement of a run's CPU seconds).
    _reap(0)


class _Stop(Exception):
    pass


def _stop(*_: object) -> None:
    raise _Stop


def _reap(flags: int) -> None:
    """Wait for the minders that ended (``os.WNOHANG``) or for all of them (0)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, flags)[0] != 0:
            pass


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    head, _, body = data.partition(b"\n")
    while len(body) < int(head):
        chunk = conn.recv(1 << 16)
        assert chunk, "the client left mid-request"
        body += chunk
    return json.loads(body), fds


def _mind(conn: socket.socket) -> None:
    """A minder: fork the rank, report its pid and then its wait status to the client."""
    code = 1
    try:
        request, fds = _read_request(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        rank = os.pidfd_open(pid)
        while conn in select.select([rank, conn], [], [])[0]:
            if not conn.recv(1):  # the client ended (torchrun killed it): so does its rank
                os.kill(pid, signal.SIGKILL)
                break
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{status}\n".encode())
        code = 0
    finally:
        os._exit(code)


def _rank(request: dict, fds: list[int]) -> None:
    """The forked rank: the client's stdio, folder, environment and arguments, then the entry
    module as ``__main__`` (as ``python -u -m verl_megatron.train`` under torchrun)."""
    import runpy
    import traceback

    code = 1
    try:
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module = request["module"]
        sys.argv = [module, *request["argv"]]
        sys.modules.pop(module, None)  # preloaded as a module; runs afresh as __main__, as with -m
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _forward(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the rank ended already
        os.kill(pid, number)


def _client(argv: list[str]) -> int:
    """torchrun's worker: the rank forked by the zygote, ended as it ends."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(os.environ[SOCKET_VAR])
    module, argv = (argv[1], argv[2:]) if argv[:1] == ["-m"] else (ENTRY, argv)
    request = {"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    body = json.dumps(request).encode()
    socket.send_fds(conn, [f"{len(body)}\n".encode()], [0, 1, 2])
    conn.sendall(body)
    replies = conn.makefile("rb")
    pid = int(replies.readline())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the launcher's stop reaches the rank
        signal.signal(sig, lambda number, _: _forward(pid, number))
    line = replies.readline()
    if not line:
        return 1
    status = int(line)
    if os.WIFSIGNALED(status):  # end by the same signal: torchrun reports "exitcode: -9"
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        _zygote(sys.argv[2])
    else:
        sys.exit(_client(sys.argv[1:]))
