"""Load a user's ``compute_score`` from a Python file anywhere on disk."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any


def _module_name_for(path: str) -> str:
    # One stable module name per file: registered in sys.modules, functions
    # pickle by reference and two different files never collide.
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    return f"verl_megatron_custom_reward_{digest}"


def _load_function(path: str, name: str) -> Callable[..., Any]:
    module_name = _module_name_for(path)
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"custom reward function file {path!r} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise RuntimeError(
                f"failed to load custom reward function file {path!r}: {type(err).__name__}: {err}"
            ) from err
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"custom reward function {name!r} not found in {path!r}; callables defined there: {defined}"
        )
    if not callable(fn):
        raise TypeError(
            f"custom reward function {name!r} in {path!r} is a {type(fn).__name__}, not a function"
        )
    return fn


class FileFunction:
    """A function named ``name`` in the file at ``path``, loaded on first use.

    It pickles as (path, name), so a process pool started with ``spawn`` (a
    fresh interpreter that cannot import the file by module name) reloads it.
    """

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        self.name = name
        self._fn: Callable[..., Any] | None = None

    def load(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = _load_function(self.path, self.name)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __getstate__(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.path, self.name, self._fn = state["path"], state["name"], None

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}, {self.name!r})"


def load_custom_compute_score(
    path: str, name: str = "compute_score", reward_kwargs: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """Import ``name`` from the Python file ``path`` now (so a bad file fails at
    start-up, with the path and name in the error) and bind ``reward_kwargs``.

    Raises FileNotFoundError for a missing file, RuntimeError when the file
    does not import (syntax error, failing import), AttributeError when it
    has no ``name``.
    """
    full_path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full_path):
        raise FileNotFoundError(
            f"custom reward function file not found: {path!r} (resolved to {full_path!r})"
        )
    fn = FileFunction(full_path, str(name))
    fn.load()
    kwargs = dict(reward_kwargs or {})
    return functools.partial(fn, **kwargs) if kwargs else fn
