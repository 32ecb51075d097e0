"""Building TensorDicts that carry per-sample Python objects beside tensors (verl's layout).

Per-sample lists (strings, lists, dicts) become a ``NonTensorStack`` of one ``NonTensorData`` per
sample, so nested structures of any shape survive; batch-wide values become ``NonTensorData``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl_megatron.errors import VerlCompatError

__all__ = ["get_tensordict", "non_tensor_stack"]


def non_tensor_stack(values: list | np.ndarray) -> NonTensorStack:
    """One ``NonTensorData`` per sample, stacked: [B] objects of any (nested) structure."""
    return NonTensorStack.from_list([NonTensorData(item) for item in values])


def get_tensordict(
    tensor_dict: dict[str, torch.Tensor | list | np.ndarray | NonTensorStack],
    non_tensor_dict: dict[str, Any] | None = None,
) -> TensorDict:
    """A TensorDict with batch size [B] from tensors [B, ...] and per-sample lists of length B,
    plus batch-wide ``non_tensor_dict`` entries stored as ``NonTensorData``."""
    items: dict[str, Any] = {}
    batch_size: int | None = None
    first_key = None
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested and value.layout != torch.jagged:
                raise VerlCompatError(f"get_tensordict: nested tensor '{key}' must use layout=torch.jagged")
            items[key], length = value, value.size(0)
        elif isinstance(value, NonTensorStack):
            items[key], length = value, len(value)
        elif isinstance(value, list | np.ndarray):
            if any(isinstance(item, torch.Tensor) for item in value):
                raise VerlCompatError(
                    f"get_tensordict: list '{key}' holds tensors; a list is stored as Python objects, "
                    "so convert them to numpy or pass one stacked tensor"
                )
            items[key], length = non_tensor_stack(value), len(value)
        else:
            raise VerlCompatError(
                f"get_tensordict: '{key}' is a {type(value).__name__}; expected a tensor, list or numpy array"
            )
        if batch_size is None:
            batch_size, first_key = length, key
        elif length != batch_size:
            raise VerlCompatError(
                f"get_tensordict: '{key}' has {length} rows but '{first_key}' has {batch_size}"
            )
    for key, value in (non_tensor_dict or {}).items():
        if key in items:
            raise VerlCompatError(f"get_tensordict: '{key}' is both a batch entry and a non-tensor entry")
        items[key] = NonTensorData(value)
    return TensorDict(items, batch_size=[] if batch_size is None else [batch_size])
