"""Load a user's ``compute_score`` from a Python file anywhere on disk."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from verl_megatron.utils.import_utils import import_python_file


def _load_function(path: str, name: str) -> Callable[..., Any]:
    try:
        module = import_python_file(path, prefix="verl_megatron_custom_reward")
    except Exception as err:
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
