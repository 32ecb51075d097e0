"""The layout tests' closeness report: it names the tensor, the index and the differences."""

from __future__ import annotations

import math

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report, max_abs_diff


def test_report_names_tensor_index_and_differences():
    expected = {"a.weight": torch.zeros(3, 4), "b.bias": torch.ones(2)}
    actual = {"a.weight": torch.zeros(3, 4), "b.bias": torch.ones(2)}
    actual["a.weight"][1, 2] = 0.5
    actual["a.weight"][2, 0] = -2e-4
    with pytest.raises(AssertionError) as err:
        assert_close_report(actual, expected, rtol=0, atol=1e-5, what="weights")
    message = str(err.value)
    assert message.startswith("weights differs (1 of 2 tensors):")
    assert "weights['a.weight']: 2 of 12 elements outside atol=1e-05" in message
    assert "max abs diff 0.5 at [1, 2] (actual 0.5, expected 0); max rel diff inf at [1, 2]" in message
    assert "b.bias" not in message


def test_relative_tolerance_nan_and_infinities():
    assert_close_report([1.0, 1000.0], [1.0, 1000.5], rtol=1e-3, atol=0, what="x")
    assert_close_report([math.nan, math.inf], [math.nan, math.inf], rtol=0, atol=0, what="x")
    with pytest.raises(AssertionError, match=r"max rel diff 0.5 at \[0\]"):
        assert_close_report([3.0], [2.0], rtol=1e-3, atol=0, what="x")
    with pytest.raises(AssertionError, match="1 of 1 elements"):
        assert_close_report([math.nan], [1.0], rtol=1, atol=1, what="x")
    with pytest.raises(AssertionError, match="1 of 1 elements"):
        assert_close_report([1.0], [math.inf], rtol=1, atol=1, what="x")


def test_names_shapes_and_per_step_metrics():
    with pytest.raises(AssertionError, match=r"only in actual: \[\"m\['x'\]\"\]"):
        assert_close_report({"x": 1.0}, {"y": 1.0}, rtol=0, atol=0, what="m")
    with pytest.raises(AssertionError, match=r"shape \(3,\) != expected \(2,\)"):
        assert_close_report(torch.zeros(3), torch.zeros(2), rtol=0, atol=0, what="t")
    with pytest.raises(AssertionError, match=r"m\[1\]\['loss'\]"):
        assert_close_report(
            [{"loss": 1.0}, {"loss": 2.0}], [{"loss": 1.0}, {"loss": 2.5}], rtol=0, atol=0, what="m"
        )
    assert max_abs_diff({"a": [1.0, 2.0]}, {"a": [1.0, 2.25]}) == 0.25


def test_adam_weights_allow_a_few_outliers_but_not_a_shifted_tensor():
    expected = {"w": torch.zeros(100, 100)}
    few = {"w": torch.zeros(100, 100)}
    few["w"][0, :20] = 1e-5  # 0.2% of the elements, within the tail bound
    assert_adam_weights_close(few, expected, lr=1e-2, steps=2, what="weights")
    row = {"w": torch.zeros(100, 100)}
    row["w"][:, 0] = 3e-6  # 1% of the elements above the bulk bound
    with pytest.raises(AssertionError, match=r"100 of 10000 elements differ by more than 2e-06"):
        assert_adam_weights_close(row, expected, lr=1e-2, steps=2, what="weights")
    one = {"w": torch.zeros(100, 100)}
    one["w"][5, 5] = 2e-4  # beyond 0.5% of lr per step
    with pytest.raises(AssertionError, match=r"max abs diff 0.0002 at \[5, 5\]"):
        assert_adam_weights_close(one, expected, lr=1e-2, steps=2, what="weights")
