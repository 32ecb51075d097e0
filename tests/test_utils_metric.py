"""verl's Metric / reduce_metrics / append_to_dict (utils.metric, utils.py_functional)."""

from __future__ import annotations

import pytest
import torch

from verl_megatron.utils.metric import AggregationType, Metric, reduce_metrics
from verl_megatron.utils.py_functional import append_to_dict


def test_metric_aggregations_and_dp() -> None:
    assert Metric("sum", [1.0, torch.tensor(2.5), 3]).aggregate() == 6.5
    assert Metric(AggregationType.MAX, [1.0, 4.0]).aggregate() == 4.0
    # dp: SUM / MEAN average the ranks per micro-batch first; MIN / MAX look at every value
    ranks = [Metric("sum", [1.0, 3.0]), Metric("sum", [3.0, 5.0])]
    assert Metric.aggregate_dp(ranks) == pytest.approx(6.0)
    assert Metric.aggregate_dp([Metric("min", [1.0, 3.0]), Metric("min", [0.5, 5.0])]) == 0.5
    with pytest.raises(ValueError, match="same number of values"):
        Metric.aggregate_dp([Metric("sum", [1.0]), Metric("sum", [1.0, 2.0])])
    with pytest.raises(ValueError, match="Unsupported aggregation type: 'median'"):
        Metric("median")
    with pytest.raises(ValueError, match="Only scalar tensors"):
        Metric("sum", torch.ones(2))
    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric("sum").extend(Metric("mean", [1.0]))


def test_append_to_dict_and_reduce_metrics() -> None:
    collected: dict = {}
    for loss in (0.25, 0.5):
        append_to_dict(
            collected, {"critic/vf_loss": Metric("sum", loss), "max_len": 3, "min_len": [1, 2], "lr": 0.1}
        )
    assert isinstance(collected["critic/vf_loss"], Metric) and collected["min_len"] == [1, 2, 1, 2]
    assert reduce_metrics(collected) == {
        "critic/vf_loss": 0.75,
        "max_len": 3,
        "min_len": 1,
        "lr": pytest.approx(0.1),
    }
    prefixed: dict = {}
    append_to_dict(prefixed, {"a": 1, "val/b": 2}, prefix="val/")
    assert prefixed == {"val/a": [1], "val/b": [2]}
