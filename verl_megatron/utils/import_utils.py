"""Load a user's object named by ``pkg.module:name`` or ``/path/to/file.py:name``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any


def import_python_file(path: str, prefix: str = "verl_megatron_user") -> ModuleType:
    """Import the Python file at ``path`` (anywhere on disk) as a module, once per file.

    The module is registered in ``sys.modules`` under a name derived from the path, so its
    functions pickle by reference and two files never collide. Errors raised while executing
    the file propagate unchanged (and leave nothing registered).
    """
    module_name = f"{prefix}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_object(spec: str, where: str) -> Any:
    """Import and return the object ``spec`` names; errors name the config key ``where`` and the spec.

    A ``.py`` path is imported as a fresh module (it may live anywhere); otherwise the part before
    ``:`` is an importable module. Called at start-up, so a bad spec fails before any model is built.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{where}={spec!r}: expected 'pkg.module:name' or '/path/file.py:name'")
    if target.endswith(".py"):
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where}={spec!r}: file not found: {path}")
        try:
            module = import_python_file(path)
        except Exception as err:
            raise RuntimeError(
                f"{where}={spec!r}: importing {path} failed: {type(err).__name__}: {err}"
            ) from err
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ImportError(f"{where}={spec!r}: cannot import module {target!r}: {err}") from err
    if not hasattr(module, name):
        raise AttributeError(f"{where}={spec!r}: {target} has no attribute {name!r}")
    return getattr(module, name)
