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

:func:`factory_made` tells what a factory that is not a class makes (:class:`EnvMade`), by making
one instance where the sessions' instances live: in a worker of its own (``isolation: process``)
or here (``none``).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
import typing
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from verl_megatron.utils.call_worker import CallWorker
from verl_megatron.utils.call_worker import WorkerCallError as EnvCallError

__all__ = [
    "EnvCallError",
    "EnvMade",
    "InProcessSession",
    "WorkerSession",
    "class_made",
    "dump_observation",
    "factory_made",
]

_LIMIT_KEY = "rollout.agent.kwargs.env_timeout_s"


def _action_class(env_type: type, action_base: type) -> type | None:
    """The ActT of the first ``Environment[ActT, ...]`` among the class's generic bases."""
    for klass in env_type.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and issubclass(args[0], action_base):
                return args[0]
    return None


@dataclasses.dataclass(frozen=True)
class EnvMade:
    """What an environment factory makes, as values that cross back from a worker."""

    type_name: str
    is_environment: bool = False
    concurrent: bool = False  # its SUPPORTS_CONCURRENT_SESSIONS
    action: type | None = None  # :func:`_action_class` of its type (None: none, or not importable here)
    kwargs_error: str = ""  # the factory's TypeError for env_kwargs ("": it took them)


def class_made(env_type: type, action_base: type) -> EnvMade:
    """What an Environment subclass makes, read from the class."""
    concurrent = bool(getattr(env_type, "SUPPORTS_CONCURRENT_SESSIONS", False))
    return EnvMade(env_type.__name__, True, concurrent, _action_class(env_type, action_base))


def _make_one(factory: Callable[..., Any], env_kwargs: dict[str, Any], environment: type,
              action_base: type) -> EnvMade:  # fmt: skip
    """Make one instance with ``factory``, close it, and say what it was. A TypeError is taken for
    one of ``env_kwargs`` only where there are some; without any it is the factory's own error."""
    try:
        env = factory(**env_kwargs)
    except TypeError as err:
        if not env_kwargs:
            raise
        return EnvMade("", kwargs_error=str(err))
    if not isinstance(env, environment):
        return EnvMade(type(env).__name__)
    env.close()
    return class_made(type(env), action_base)


def _by_reference(klass: type | None) -> type | None:
    """``klass`` where it pickles by name (its module imports it here too), else None."""
    try:
        pickle.dumps(klass)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    return klass


def _made_in_worker(factory: Callable[..., Any], env_kwargs: dict[str, Any], environment: type,
                    action_base: type, op: str, args: Any) -> EnvMade:  # fmt: skip
    """The worker's server: ``op`` names the factory in errors; ``args`` is empty."""
    made = _make_one(factory, env_kwargs, environment, action_base)
    return dataclasses.replace(made, action=_by_reference(made.action))


def factory_made(factory: Callable[..., Any], env_kwargs: dict[str, Any], environment: type,
                 action_base: type, isolation: str, timeout_s: float) -> EnvMade:  # fmt: skip
    """What ``factory(**env_kwargs)`` makes, made (and closed) where ``isolation`` puts the
    instances: a worker of its own within ``timeout_s`` (errors as :class:`WorkerSession`'s
    calls'), or this process (``none``, trusted code)."""
    if isolation == "none":
        return _make_one(factory, env_kwargs, environment, action_base)
    server = functools.partial(_made_in_worker, factory, env_kwargs, environment, action_base)
    worker = CallWorker(server, "environment", _LIMIT_KEY)
    try:
        return worker.call(getattr(factory, "__name__", "factory"), {}, timeout_s)
    finally:
        worker.kill()


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
        self.worker = CallWorker(server, "environment", _LIMIT_KEY)

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
