"""verl's ``utils.metric``: `Metric`, `AggregationType`, `reduce_metrics`."""

from verl_megatron.utils.metric.utils import AggregationType, Metric, reduce_metrics

__all__ = ["AggregationType", "Metric", "reduce_metrics"]
