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

import contextlib
import importlib
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import socket
import sys
import traceback
from typing import Any

_JOB_TIMEOUT_S = 900


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


class DistPool:
    """``world_size`` processes in one gloo group, running jobs on request."""

    def __init__(self, world_size: int, threads_per_rank: int = 1) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        env = {
            "OMP_NUM_THREADS": str(threads_per_rank),
            # Idle OpenMP threads spinning on a 2-core machine starve the peer rank.
            "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        self.world_size = world_size
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
        """Run ``target(**kwargs)`` on every rank; return results in rank order."""
        for conn in self._conns:
            conn.send((target, kwargs))
        results, errors = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                self.close(force=True)
                raise TimeoutError(f"rank {rank} did not finish {target} within {timeout_s:.0f}s")
            status, payload = conn.recv()
            (results if status == "ok" else errors).append(payload)
        if errors:
            raise RuntimeError(f"job {target} failed:\n" + "\n".join(errors))
        return results

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not force:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 20)
            if proc.is_alive():
                proc.kill()
        self._procs, self._conns = [], []
