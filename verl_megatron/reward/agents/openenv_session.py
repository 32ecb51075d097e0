"""Where an OpenEnv environment instance lives for one trajectory (reward/agents/openenv_env.py).

:class:`WorkerSession` (the default, ``rollout.agent.kwargs.isolation: process``): the instance
is made in a worker process of its own (``worker.py``: forked, killed with the trainer, inherited
file descriptors closed); ``reset`` / ``step`` / ``close`` are calls to it, each with a
wall-clock limit (``env_timeout_s``, clipped to the batch's deadline). Actions and observations
cross as plain dicts (``model_dump`` / ``model_validate``). A call that raises or kills the
worker raises RuntimeError (:class:`EnvCallError` when it raised), one past its limit
TimeoutError (the trajectory's failure: ``error`` / ``timeout``); the worker is killed and reaped
whenever the session ends. :class:`InProcessSession` (``isolation: none``): the instance in the
calling thread, as trusted code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from verl_megatron.reward.agents.worker import CallWorker
from verl_megatron.reward.agents.worker import WorkerCallError as EnvCallError

__all__ = ["EnvCallError", "InProcessSession", "WorkerSession", "dump_observation"]


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


class WorkerSession:
    """One environment instance in its own worker process (module docstring)."""

    def __init__(self, factory: Callable[..., Any], env_kwargs: dict[str, Any], action: type,
                 timeout_s: float, deadline: float = float("inf")) -> None:  # fmt: skip
        self.timeout_s, self.deadline = timeout_s, deadline
        server = _EnvServer(factory, env_kwargs, action)
        self.worker = CallWorker(server, "environment", "rollout.agent.kwargs.env_timeout_s")

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        limit = min(self.timeout_s, self.deadline - time.monotonic())
        return self.worker.call(op, args, limit)

    def reset(self, **kwargs: Any) -> tuple[dict[str, Any], str]:
        return self._call("reset", kwargs)

    def step(self, action: Any) -> dict[str, Any]:
        return self._call("step", {"action": action.model_dump()})

    def close(self) -> None:
        """``env.close()`` within the limit when the worker is alive; then kill and reap it."""
        try:
            if self.worker.alive:
                self._call("close", {})
        except (RuntimeError, TimeoutError):
            pass  # the trajectory already ended; a failing close() changes nothing
        finally:
            self.worker.kill()


class InProcessSession:
    """The instance in this process; ``lock`` serializes calls (no concurrent sessions)."""

    def __init__(self, factory: Callable[..., Any], env_kwargs: dict[str, Any],
                 lock: AbstractContextManager) -> None:  # fmt: skip
        self.env, self.lock = factory(**env_kwargs), lock

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
