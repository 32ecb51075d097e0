"""Small dict helpers with verl's names (``verl.utils.py_functional``)."""

from __future__ import annotations

from typing import Any

from verl_megatron.utils.metric import Metric

__all__ = ["append_to_dict"]


def append_to_dict(data: dict[str, Any], new_data: dict[str, Any], prefix: str = "") -> None:
    """Append each value of `new_data` to the list (or Metric) under its key in `data`,
    creating it on first use; a list value is appended element by element. Keys get
    `prefix` unless they already start with it."""
    for key, value in new_data.items():
        name = key if key.startswith(prefix) else f"{prefix}{key}"
        if name not in data:
            data[name] = value.init_list() if isinstance(value, Metric) else []
        if isinstance(value, list):
            data[name].extend(value)
        else:
            data[name].append(value)
