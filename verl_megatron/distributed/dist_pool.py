"""A persistent pool of torch.distributed worker processes (gloo) for tests and benchmarks.

Spawning processes and importing megatron-core costs seconds per process, so
multi-process tests share one pool per world size: the workers start once,
join one process group, and then run any number of jobs. A job is an
importable function ``"package.module:function"`` called on every rank with
the same keyword arguments; the pool returns the per-rank results in rank
order, or raises with the failing rank's traceback.

Jobs usually begin with ``init_runtime(layout)``, which rebuilds megatron's
parallel state for the layout they need on the shared process group.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.util as mp_util
import os
import socket
import sys
import time
import traceback
from typing import Any

_JOB_TIMEOUT_S = 900
# After one rank fails, how long the others may take to report before they are presumed stuck
# in a collective waiting for it.
_STRAGGLER_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str):
    module_name, _, fn_name = target.partition(":")
    if not fn_name:
        raise ValueError(f"job target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), fn_name)


def _worker(rank: int, world_size: int, port: int, conn, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    from verl_megatron.distributed.parallel import init_process_group
    from verl_megatron.distributed.wire import guard_torch_distributed

    init_process_group()
    guard_torch_distributed()  # gloo carries dtypes NCCL refuses: a job sending one fails here
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone without saying goodbye
            break
        if message is None:
            break
        target, kwargs = message
        try:
            result = _resolve(target)(**kwargs)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    from verl_megatron.distributed.parallel import shutdown

    shutdown()
    _exit_without_teardown()


def _exit_without_teardown() -> None:
    """End the worker once its groups are destroyed, skipping the interpreter's teardown.

    Tearing down an interpreter that loaded torch and megatron and ran a session's jobs (freeing
    every module and object one by one) took ~3 s of CPU per worker, and about 14 s of closing
    pool1 and pool2 on a loaded 2-core machine, to free memory the OS reclaims at exit anyway.
    The exit handlers still run: multiprocessing joins the worker's own child processes, logging
    flushes.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


class DistPool:
    """``world_size`` processes in one gloo group, running jobs on request."""

    def __init__(self, world_size: int, threads_per_rank: int = 1, start_method: str = "spawn") -> None:
        # "fork": the workers start with the caller's imports (megatron's cost seconds of CPU
        # each); only for a caller with no threads that hold locks, and no process group (each
        # worker would inherit the caller's and form its own over it).
        if start_method == "fork":
            import torch.distributed as dist

            if dist.is_initialized():
                raise ValueError(
                    "DistPool(start_method='fork') from a process that has a process group: use 'spawn'"
                )
        ctx = mp.get_context(start_method)
        port = _free_port()
        env = {
            "OMP_NUM_THREADS": str(threads_per_rank),
            # Idle OpenMP threads spinning on a 2-core machine starve the peer rank.
            "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        self.world_size = world_size
        self._closed: str | None = None  # why the pool no longer runs jobs
        self._conns = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            # Not daemonic: a job may start processes of its own, as the trainer does (the
            # contained reward scorers), and daemonic processes may not have children.
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, env), daemon=False)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        # multiprocessing joins non-daemonic children at interpreter exit; kill ours first
        # (finalizers with an exit priority run before that join) so a pool never left
        # closed cannot hang the exit.
        mp_util.Finalize(None, self.close, kwargs={"force": True}, exitpriority=10)

    def run(self, target: str, timeout_s: float = _JOB_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``target(**kwargs)`` on every rank; return results in rank order.

        Waits on all ranks together under one deadline. When a rank fails, the others get
        :data:`_STRAGGLER_GRACE_S` to report too (ranks failing the same check do so within
        milliseconds); one that has not by then is presumed stuck in a collective with the
        failed rank, and the pool is closed. A timeout or a rank that exits closes it as well.
        """
        if self._closed is not None:
            raise RuntimeError(f"cannot run {target}: the pool is closed ({self._closed})")
        for conn in self._conns:
            conn.send((target, kwargs))
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple[str, Any]] = {}
        while len(replies) < self.world_size:
            waiting = {conn: rank for rank, conn in enumerate(self._conns) if rank not in replies}
            ready = mp_connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail_stragglers(target, timeout_s, replies, sorted(waiting.values()))
            for conn in ready:
                rank = waiting[conn]
                replies[rank] = self._receive(rank, conn)
                if replies[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + _STRAGGLER_GRACE_S)
        if any(status == "exited" for status, _ in replies.values()):
            self.close(force=True, reason=f"a rank exited during {target}")
        errors = [payload for _, (status, payload) in sorted(replies.items()) if status != "ok"]
        if errors:
            raise RuntimeError(f"job {target} failed:\n" + "\n".join(errors))
        return [replies[rank][1] for rank in range(self.world_size)]

    def _receive(self, rank: int, conn) -> tuple[str, Any]:
        try:
            return conn.recv()
        except (EOFError, OSError):  # the worker died (killed, os._exit, a crash in C)
            self._procs[rank].join(timeout=5)
            return "exited", f"rank {rank}: the worker exited (exit code {self._procs[rank].exitcode})"

    def _fail_stragglers(self, target: str, timeout_s: float, replies: dict, pending: list[int]):
        errors = [payload for _, (status, payload) in sorted(replies.items()) if status != "ok"]
        names = ", ".join(f"rank {rank}" for rank in pending)
        if not errors:
            self.close(force=True, reason=f"{names} did not finish {target} within {timeout_s:.0f}s")
            raise TimeoutError(f"{names} did not finish {target} within {timeout_s:.0f}s")
        self.close(force=True, reason=f"{names} hung after a failure in {target}")
        raise RuntimeError(
            f"job {target} failed:\n"
            + "\n".join(errors)
            + f"\n({names} had not finished when the wait ended, presumably waiting in a collective "
            "for the failed rank: the pool is closed)"
        )

    def close(self, force: bool = False, reason: str = "close() was called") -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not force:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 20)
            if proc.is_alive():
                proc.kill()
        self._procs, self._conns = [], []
        if self._closed is None:
            self._closed = reason
