"""Where an OpenEnv environment instance lives for one trajectory (reward/agents/openenv_env.py).

:class:`WorkerSession` (the default, ``rollout.agent.kwargs.isolation: process``): the instance
is made in a worker process of its own (forked where available, killed with the trainer as the
reward scorers' workers are, ``managers/scoring.py``; it first closes every file descriptor it
inherited but its pipe, since it is forked from one of the rollout's threads while others may
be starting a subprocess, whose start waits for every copy of a pipe to close); ``reset`` /
``step`` / ``close`` are calls to
it, each with a wall-clock limit (``env_timeout_s``). Actions and observations cross as plain
dicts (``model_dump`` / ``model_validate``). A call that raises or kills the worker raises
RuntimeError, one past its limit TimeoutError (the trajectory's failure: ``error`` / ``timeout``);
the worker is killed and reaped whenever the session ends. :class:`InProcessSession`
(``isolation: none``): the instance in the calling thread, as trusted code.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from verl_megatron.reward.managers.scoring import _die_with_parent

_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 5.0

__all__ = ["EnvCallError", "InProcessSession", "WorkerSession", "dump_observation"]


class EnvCallError(RuntimeError):
    """A call of the worker's environment raised; ``detail``: ``"ExcType: message"``."""

    def __init__(self, op: str, detail: str) -> None:
        super().__init__(f"the environment's {op}() raised {detail}")
        self.detail = detail


def dump_observation(observation: Any) -> dict[str, Any]:
    """An observation as the plain dict the harness reads (its JSON-mode fields)."""
    return observation.model_dump(mode="json")


class _EnvServer:
    """Runs in the worker: one environment instance, made by the first reset."""

    def __init__(self, factory: Callable[..., Any], env_kwargs: dict[str, Any], action: type) -> None:
        self.factory, self.env_kwargs, self.action = factory, env_kwargs, action
        self.env: Any = None

    def __call__(self, op: str, args: dict[str, Any]) -> Any:
        if op == "reset":
            self.env = self.factory(**self.env_kwargs)
            observation = self.env.reset(**args)
            return dump_observation(observation), type(observation).__name__
        if op == "step":
            return dump_observation(self.env.step(self.action.model_validate(args["action"])))
        if self.env is not None:  # close
            self.env.close()
        return None


def _serve(conn: Any, server: _EnvServer) -> None:
    """The worker's loop: (op, args) in, (ok, result or "ExcType: message") out."""
    keep = conn.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    conn.send((True, None))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, server(op, args))
        except BaseException as err:  # SystemExit from the environment must not end the worker
            reply = (False, f"{type(err).__name__}: {err}")
        conn.send(reply)


class WorkerSession:
    """One environment instance in its own worker process (module docstring)."""

    def __init__(self, factory: Callable[..., Any], env_kwargs: dict[str, Any], action: type,
                 timeout_s: float, deadline: float = float("inf")) -> None:  # fmt: skip
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.timeout_s, self.deadline = timeout_s, deadline
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_serve, args=(child, _EnvServer(factory, env_kwargs, action)), daemon=True
        )
        try:
            self.process.start()
        finally:
            child.close()
        self.pid = self.process.pid
        try:
            if not self.conn.poll(_START_TIMEOUT_S):
                raise RuntimeError(
                    f"the environment's worker process did not start within {_START_TIMEOUT_S:g} s"
                )
            self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(
                f"the environment's worker process died while starting (exit code {self.process.exitcode})"
            ) from None
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL the worker (when alive), close the pipe, reap it."""
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
        self.process.join(_STOP_TIMEOUT_S)

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        limit = max(0.0, min(self.timeout_s, self.deadline - time.monotonic()))
        try:
            self.conn.send((op, args))
            arrived = self.conn.poll(limit)
            if arrived:
                ok, payload = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise RuntimeError(
                f"the environment's worker process died in {op}() (exit code {self.process.exitcode})"
            ) from None
        if not arrived:
            self.kill()
            raise TimeoutError(
                f"the environment's {op}() did not return within {limit:g} s "
                "(rollout.agent.kwargs.env_timeout_s; worker process killed)"
            )
        if not ok:
            raise EnvCallError(op, payload)
        return payload

    def reset(self, **kwargs: Any) -> tuple[dict[str, Any], str]:
        return self._call("reset", kwargs)

    def step(self, action: Any) -> dict[str, Any]:
        return self._call("step", {"action": action.model_dump()})

    def close(self) -> None:
        """``env.close()`` within the limit when the worker is alive; then kill and reap it."""
        try:
            if self.process.is_alive() and not self.conn.closed:
                self._call("close", {})
        except (RuntimeError, TimeoutError):
            pass  # the trajectory already ended; a failing close() changes nothing
        finally:
            self.kill()


class InProcessSession:
    """The instance in this process; ``lock`` serializes calls (no concurrent sessions)."""

    def __init__(self, factory: Callable[..., Any], env_kwargs: dict[str, Any],
                 lock: AbstractContextManager) -> None:  # fmt: skip
        self.env, self.lock, self.pid = factory(**env_kwargs), lock, None

    def reset(self, **kwargs: Any) -> tuple[dict[str, Any], str]:
        with self.lock:
            observation = self.env.reset(**kwargs)
        return dump_observation(observation), type(observation).__name__

    def step(self, action: Any) -> dict[str, Any]:
        with self.lock:
            return dump_observation(self.env.step(action))

    def close(self) -> None:
        with self.lock:
            self.env.close()
