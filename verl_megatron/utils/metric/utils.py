"""Metric accumulation with an explicit reduction (verl's ``utils.metric``).

A `Metric` collects scalar values (e.g. one per micro-batch) and knows how they
combine: MEAN for per-token averages, SUM for partial sums normalised by global counts
(a loss computed with ``agg_loss``'s global token count adds up to the mini-batch loss
over micro-batches), MIN / MAX for extremes. Plain lists reduce by their key name:
"max" in the name -> max, "min" -> min, else mean.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np
import torch

__all__ = ["AggregationType", "Metric", "reduce_metrics"]

Numeric = int | float | torch.Tensor | np.ndarray
_NUMERIC = (int, float, torch.Tensor, np.ndarray, np.number)


class AggregationType(Enum):
    """How the values of a `Metric` combine into one number."""

    MEAN = "mean"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


_REDUCE = {
    AggregationType.MEAN: np.mean,
    AggregationType.SUM: np.sum,
    AggregationType.MIN: np.min,
    AggregationType.MAX: np.max,
}


class Metric:
    """Scalar values and their aggregation (a string such as "sum" or an AggregationType)."""

    def __init__(
        self, aggregation: str | AggregationType, value: Numeric | list[Numeric] | None = None
    ) -> None:
        try:
            self.aggregation = AggregationType(aggregation)
        except ValueError:
            names = [a.value for a in AggregationType]
            raise ValueError(f"Unsupported aggregation type: {aggregation!r}; use one of {names}") from None
        self.values: list[Any] = []
        if value is not None:
            if isinstance(value, list):
                self.extend(value)
            else:
                self.append(value)

    def append(self, value: Numeric | Metric) -> None:
        """Add one scalar (a one-element tensor is read as a float), or every value of a Metric."""
        if isinstance(value, Metric):
            self.extend(value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"Only scalar tensors can be converted to float, got shape {tuple(value.shape)}"
                )
            value = value.detach().item()
        if not isinstance(value, _NUMERIC):
            raise ValueError(f"Unsupported value type: {type(value).__name__}")
        self.values.append(value)

    def extend(self, values: Metric | list[Numeric]) -> None:
        """Add several values; a Metric must have the same aggregation."""
        if isinstance(values, Metric):
            if values.aggregation != self.aggregation:
                raise ValueError(f"Aggregation type mismatch: {self.aggregation} != {values.aggregation}")
            values = values.values
        for value in values:
            self.append(value)

    def aggregate(self) -> float:
        """The values reduced with this metric's aggregation."""
        return _REDUCE[self.aggregation](self.values)

    @classmethod
    def aggregate_dp(cls, metric_lists: list[Metric]) -> float:
        """Combine the same metric from several dp ranks (one value per micro-batch each):
        SUM / MEAN reduce the per-micro-batch mean over ranks, MIN / MAX all values."""
        if not metric_lists:
            raise ValueError("Cannot aggregate an empty list of metrics.")
        lengths = [len(m.values) for m in metric_lists]
        if len(set(lengths)) != 1:
            raise ValueError(
                f"All Metric instances must have the same number of values for dp aggregation: {lengths}"
            )
        values = np.array([m.values for m in metric_lists])  # [dp, micro-batches]
        aggregation = metric_lists[0].aggregation
        if aggregation in (AggregationType.SUM, AggregationType.MEAN):
            return _REDUCE[aggregation](values.mean(axis=0))
        return _REDUCE[aggregation](values.flatten())

    @classmethod
    def from_dict(cls, data: dict[str, Numeric], aggregation: str | AggregationType) -> dict[str, Metric]:
        """One Metric per key, holding that key's value."""
        return {key: cls(aggregation=aggregation, value=value) for key, value in data.items()}

    def init_list(self) -> Metric:
        """An empty Metric with the same aggregation."""
        return Metric(aggregation=self.aggregation)


def reduce_metrics(metrics: dict[str, Metric | list[Any]]) -> dict[str, Any]:
    """Reduce every entry in place and return the dict: a Metric by its aggregation; a list
    by its name ("max" in it -> max, "min" -> min, else mean)."""
    for key, value in metrics.items():
        if isinstance(value, Metric):
            metrics[key] = value.aggregate()
        elif "max" in key:
            metrics[key] = np.max(value)
        elif "min" in key:
            metrics[key] = np.min(value)
        else:
            metrics[key] = np.mean(value)
    return metrics
