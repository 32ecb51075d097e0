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
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Mapping):
        value = dict(enumerate(value))  # e.g. one metrics dict per step
    if isinstance(value, Mapping):
        out: dict[str, torch.Tensor] = {}
        for key, item in value.items():
            out.update(_as_tensors(item, f"{what}[{key!r}]" if what else str(key)))
        return out
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
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
    diff = torch.where(same, 0.0, (actual - expected).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    bad = diff > atol + rtol * expected.abs().nan_to_num(nan=0.0, posinf=0.0)
    if not bad.any():
        return None
    rel = torch.where(diff == 0, 0.0, diff / expected.abs()).nan_to_num(nan=math.inf, posinf=math.inf)
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


# Weights after float32 Adam steps. Adam's step m / (sqrt(v) + eps) turns a gradient near
# eps into a step of a sizeable fraction of lr, so float32 summation-order noise there
# moves single elements by far more than it moves the rest: the noise is heavy-tailed.
# Measured between mathematically equal single-process runs (padded vs packed vs dynamic
# micro-batches, tests/test_actor_update.py and test_critic_update.py; even vs uneven
# micro-batches, test_actor_vpp.py), 2 steps of lr=1e-2, ~20k-40k elements:
#   99.9th percentile of |diff| <= 2.3e-6, at most 0.3% of elements above 1e-6 per step,
#   max 1.4e-5 (0.07% of lr per step).
# Layouts vs one process, same runs: 99.9th percentile <= 2.6e-6; max 9.2e-5 over 4 steps
# of the critic with value clipping (0.23% of lr per step; a value at the clip edge flips).
# The bulk bound catches a bug that moves many elements; the tail bound, any element
# moved by more than noise can explain.
ADAM_BULK_ATOL_PER_STEP = 1e-6
ADAM_BULK_MAX_FRACTION = 0.005
ADAM_TAIL_LR_FRACTION_PER_STEP = 5e-3


def assert_adam_weights_close(
    actual: Mapping, expected: Mapping, *, lr: float, steps: int, what: str
) -> None:
    """Weights after ``steps`` float32 Adam steps of ``lr`` from the same start agree up to
    float32 noise: all but ADAM_BULK_MAX_FRACTION of the elements (over all tensors) within
    ADAM_BULK_ATOL_PER_STEP * steps, and every element within
    ADAM_TAIL_LR_FRACTION_PER_STEP * lr * steps."""
    tail = ADAM_TAIL_LR_FRACTION_PER_STEP * lr * steps
    assert_close_report(actual, expected, rtol=0, atol=tail, what=f"{what} (tail bound)")
    bulk = ADAM_BULK_ATOL_PER_STEP * steps
    a, e = _as_tensors(actual, what), _as_tensors(expected, what)
    outside = {name: int(((a[name] - e[name]).abs() > bulk).sum()) for name in e}
    total = sum(t.numel() for t in e.values())
    if sum(outside.values()) > ADAM_BULK_MAX_FRACTION * total:
        worst = sorted(((n, name) for name, n in outside.items() if n), reverse=True)[:5]
        raise AssertionError(
            f"{what}: {sum(outside.values())} of {total} elements differ by more than {bulk:g} "
            f"(allowed: {ADAM_BULK_MAX_FRACTION:.1%}); most in "
            + ", ".join(f"{name} ({n} of {e[name].numel()})" for n, name in worst)
        )
