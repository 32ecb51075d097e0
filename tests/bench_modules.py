"""The benchmark scripts as modules, for tests of their arithmetic: benchmarks/ goes on sys.path
(the scripts import their siblings by name) and ``name`` is imported from it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """benchmarks/``name``.py, imported by name."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
