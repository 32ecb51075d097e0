"""Deep equality for the values a ``DataProto`` carries (tensors, numpy arrays, nested Python data).

``==`` is not enough there: arrays and tensors compare element-wise and have an ambiguous truth
value, NaN never equals itself (so a batch would not union with its own copy), and object arrays
may contain themselves. ``values_equal`` answers a plain bool for all of these.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

__all__ = ["values_equal"]

_NUMBERS = (numbers.Number, np.number, np.bool_)
_REALS = (numbers.Real, np.floating, np.integer)


def values_equal(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` hold the same data: same types, shapes and dtypes, NaN equal to NaN
    at the same place, containers compared element by element (cycles compare equal)."""
    return _equal(a, b, set())


def _equal(a: Any, b: Any, active: set[tuple[int, int]]) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_equal(a, b)
    if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
        # 1 and np.int64(1) are the same value; NaN matches NaN.
        both_nan = isinstance(a, _REALS) and isinstance(b, _REALS) and math.isnan(a) and math.isnan(b)
        return both_nan or bool(a == b)
    if not isinstance(a, np.ndarray | dict | list | tuple):
        if type(a) is not type(b):
            return False
        result = a == b
        return bool(result.all()) if isinstance(result, np.ndarray) else bool(result)
    if type(a) is not type(b):
        return False
    # A pair already being compared further up is a cycle; its other elements decide.
    pair = (id(a), id(b))
    if pair in active:
        return True
    active.add(pair)
    try:
        if isinstance(a, np.ndarray):
            return _arrays_equal(a, b, active)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_equal(a[k], b[k], active) for k in a)
        return len(a) == len(b) and all(_equal(x, y, active) for x, y in zip(a, b))
    finally:
        active.discard(pair)


def _arrays_equal(a: np.ndarray, b: np.ndarray, active: set[tuple[int, int]]) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == object:
        return all(_equal(x, y, active) for x, y in zip(a.flat, b.flat))
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_nested or b.is_nested:
        if not (a.is_nested and b.is_nested) or a.size(0) != b.size(0):
            return False
        return all(_tensors_equal(x, y) for x, y in zip(a.unbind(), b.unbind()))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)
