"""A worker process for user code: the place an agent's or an environment's code runs (``isolation: process``).

:class:`CallWorker` forks a process (spawn where fork is missing) that answers calls
``server(op, args)`` over a pipe, one at a time, each with a wall-clock limit given by the
caller (``inf``: none). The worker is killed with the trainer (:func:`die_with_parent`, as the
reward scorers' workers are: ``reward/managers/scoring.py``) and first closes every file
descriptor it inherited but its pipe: it is forked from one of the rollout's threads while
others may be starting a subprocess, whose start waits for every copy of a pipe to close (so what user code opened before the fork is not
open in the worker: it opens its own). A call whose server raises raises :class:`WorkerCallError`
(``"ExcType: message"``), one that kills the worker RuntimeError, one past its limit
TimeoutError (the worker killed); :meth:`CallWorker.kill` kills and reaps it. The worker
leads a process group of its own, and a kill reaches the whole group: what user code started
(a tool server, an interpreter) ends with it unless it left the group itself.

Users: ``reward/agents/openenv_session.py`` (an OpenEnv environment instance per trajectory),
``reward/agents/contained.py`` (a harness's whole ``run`` per trajectory) and
``rollout/multiturn.py`` (a multi-turn environment's calls of one rollout call). It lives here,
below both layers, so that the rollout may use it.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 5.0
_EXIT_WAIT_S = 1.0
# Where user code runs: ``process`` (a CallWorker) or ``none`` (in the trainer: trusted code).
ISOLATION_MODES = ("process", "none")

__all__ = ["ISOLATION_MODES", "CallWorker", "WorkerCallError", "die_with_parent"]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when the trainer dies (even by SIGKILL), so a
    scorer stuck in a sleep is not left behind; elsewhere a closed pipe ends idle workers."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:  # it died before prctl
            os._exit(0)


class WorkerCallError(RuntimeError):
    """A call of the worker's server raised; ``detail``: ``"ExcType: message"``."""

    def __init__(self, what: str, op: str, detail: str) -> None:
        super().__init__(f"the {what}'s {op}() raised {detail}")
        self.detail = detail


def _serve(conn: Any, server: Callable[[str, Any], Any]) -> None:
    """The worker's loop: (op, args) in, (ok, result or "ExcType: message") out."""
    keep = conn.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    os.setsid()  # a process group of its own: kill() ends what user code started in it too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    conn.send((True, None))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, server(op, args))
        except BaseException as err:  # SystemExit from user code must not end the worker
            reply = (False, f"{type(err).__name__}: {err}")
        conn.send(reply)


class CallWorker:
    """One worker process serving ``server`` (module docstring); ``what`` names it in errors
    ("the environment's ..."), ``limit_key`` the setting a timeout's message points to."""

    def __init__(self, server: Callable[[str, Any], Any], what: str, limit_key: str) -> None:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.what, self.limit_key = what, limit_key
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child, server), daemon=True)
        try:
            self.process.start()
        finally:
            child.close()
        try:
            if not self.conn.poll(_START_TIMEOUT_S):
                raise RuntimeError(f"the {what}'s worker process did not start within {_START_TIMEOUT_S:g} s")
            self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(
                f"the {what}'s worker process died while starting (exit code {self.process.exitcode})"
            ) from None
        except BaseException:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and not self.conn.closed

    def kill(self) -> None:
        """SIGKILL the worker's process group (what user code started there: tool servers,
        subprocesses) and the worker (when alive), close the pipe, reap it."""
        if self.process.pid is not None:
            # Before the reap, or with the group's members still holding its id: the id is
            # ours, not a reused one.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
        self.process.join(_STOP_TIMEOUT_S)

    def call(self, op: str, args: Any, limit: float) -> Any:
        """``server(op, args)`` in the worker within ``limit`` seconds (module docstring)."""
        try:
            self.conn.send((op, args))
            arrived = self.conn.poll(None if limit == math.inf else max(0.0, limit))
            if arrived:
                ok, payload = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(_EXIT_WAIT_S)  # its pipe closed as it exits: its own exit code
            self.kill()
            raise RuntimeError(
                f"the {self.what}'s worker process died in {op}() (exit code {self.process.exitcode})"
            ) from None
        if not arrived:
            self.kill()
            raise TimeoutError(
                f"the {self.what}'s {op}() did not return within {max(0.0, limit):g} s "
                f"({self.limit_key}; worker process killed)"
            )
        if not ok:
            raise WorkerCallError(self.what, op, payload)
        return payload
