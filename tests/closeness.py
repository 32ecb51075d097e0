"""One closeness check for every layout-equality test, with a failure report that says where.

``torch.testing.assert_close`` with a custom ``msg`` loses the numbers, and without one
it names only a flat index. A layout test compares many named tensors (weights under
global names, per-step metrics), so the report here names the tensor, the element's
index in its own shape, the largest absolute and relative differences and how many
elements are outside the tolerance. Comparison is done in float64 so the check itself
adds no rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

Closeable = torch.Tensor | float | int | Sequence | Mapping


def _as_tensors(value: Closeable, what: str) -> dict[str, torch.Tensor]:
    """Flatten a tensor, number, list of numbers or mapping of those into named float64 tensors."""
    if isinstance(value, Mapping):
        out: dict[str, torch.Tensor] = {}
        for key, item in value.items():
            out.update(_as_tensors(item, f"{what}[{key!r}]" if what else str(key)))
        return out
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return {what: tensor.detach().cpu().to(torch.float64)}


def _report_one(
    name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> str | None:
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    both_nan = actual.isnan() & expected.isnan()
    same = (actual == expected) | both_nan  # also equal infinities
    diff = torch.where(same, 0.0, (actual - expected).abs().nan_to_num(math.inf))
    bad = diff > atol + rtol * expected.abs().nan_to_num(0.0)
    if not bad.any():
        return None
    rel = torch.where(diff == 0, 0.0, diff / expected.abs()).nan_to_num(math.inf)
    flat = int(diff.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), actual.shape))
    rflat = int(rel.reshape(-1).argmax())
    rindex = tuple(int(i) for i in torch.unravel_index(torch.tensor(rflat), actual.shape))
    return (
        f"{name}: {int(bad.sum())} of {actual.numel()} elements outside atol={atol:g} + rtol={rtol:g}*|expected|; "
        f"max abs diff {float(diff.reshape(-1)[flat]):.3g} at {list(index)} "
        f"(actual {float(actual.reshape(-1)[flat]):.9g}, expected {float(expected.reshape(-1)[flat]):.9g}); "
        f"max rel diff {float(rel.reshape(-1)[rflat]):.3g} at {list(rindex)}"
    )


def max_abs_diff(actual: Closeable, expected: Closeable) -> float:
    """Largest |actual - expected| over every element of every (named) tensor; for noise-floor checks."""
    a, e = _as_tensors(actual, ""), _as_tensors(expected, "")
    assert a.keys() == e.keys(), f"different names: {sorted(a.keys() ^ e.keys())}"
    return max((float((a[k] - e[k]).abs().max()) for k in a if a[k].numel()), default=0.0)


def assert_close_report(
    actual: Closeable, expected: Closeable, *, rtol: float, atol: float, what: str
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise (NaN equals NaN).

    ``actual``/``expected`` may be tensors, numbers, lists of numbers, or (nested) mappings
    of those with the same keys. On failure, one line per offending tensor: its name, the
    count of elements out of tolerance, and the max absolute and relative differences with
    their indices and values.
    """
    a, e = _as_tensors(actual, what), _as_tensors(expected, what)
    if a.keys() != e.keys():
        raise AssertionError(
            f"{what}: names differ; only in actual: {sorted(a.keys() - e.keys())}, "
            f"only in expected: {sorted(e.keys() - a.keys())}"
        )
    problems = [p for name in e if (p := _report_one(name, a[name], e[name], rtol, atol))]
    if problems:
        raise AssertionError(f"{what} differs ({len(problems)} of {len(e)} tensors):\n" + "\n".join(problems))
