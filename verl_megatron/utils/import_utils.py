"""Load a user's object named by ``pkg.module:name`` or ``/path/to/file.py:name``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any


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
        module_name = f"_verl_megatron_user_{abs(hash(path))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # lets pickling by reference (spawned workers) find it
        try:
            module_spec.loader.exec_module(module)
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
