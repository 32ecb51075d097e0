"""Tensors and TensorDicts as (dtype, shape, raw bytes) tuples, verl's numpy wire format.

The format holds plain numpy buffers, so pickling a batch copies bytes instead of going through
``torch.save`` (which needs a consolidated TensorDict and drags in torch's storage sharing).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_megatron.errors import VerlCompatError

__all__ = [
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "serialize_single_tensor",
    "serialize_tensordict",
]

EncodedTensor = tuple[str, tuple[int, ...], np.ndarray]


def serialize_single_tensor(tensor: torch.Tensor) -> EncodedTensor:
    """``(dtype name without 'torch.', shape, uint8 numpy buffer)`` of a dense tensor."""
    flat = tensor.detach().cpu().reshape(-1).contiguous()
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.view(torch.uint8).numpy()


def deserialize_single_tensor(encoded: EncodedTensor | tuple) -> torch.Tensor:
    """Inverse of ``serialize_single_tensor``; the result owns its memory (a CPU tensor)."""
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise VerlCompatError(f"deserialize_single_tensor: '{dtype_name}' is not a torch dtype")
    raw = bytearray(memoryview(data).cast("B")) if len(data) else bytearray()
    if not raw:  # torch.frombuffer rejects an empty buffer
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(tuple(shape))


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """``(batch_size, device or None, {key: encoding})``; a nested tensor encodes as
    ``(layout name, [encoded component, ...])``, a dense one as a 3-tuple."""
    encoded: dict[str, tuple] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise VerlCompatError(
                f"serialize_tensordict: '{key}' is a {type(value).__name__}; only tensors can be encoded"
            )
        if value.is_nested:
            layout = str(value.layout).removeprefix("torch.")
            encoded[key] = (layout, [serialize_single_tensor(part) for part in value.unbind()])
        else:
            encoded[key] = serialize_single_tensor(value)
    device = str(batch.device) if batch.device is not None else None
    return tuple(batch.batch_size), device, encoded


def deserialize_tensordict(encoded: tuple) -> TensorDict:
    """Inverse of ``serialize_tensordict`` (tensors land on the recorded device)."""
    batch_size, device, items = encoded
    decoded: dict[str, Any] = {}
    for key, value in items.items():
        if len(value) == 3:
            decoded[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            decoded[key] = torch.nested.as_nested_tensor(
                [deserialize_single_tensor(p) for p in parts], layout=getattr(torch, layout)
            )
        else:
            raise VerlCompatError(
                f"deserialize_tensordict: '{key}' has an encoding of length {len(value)}; expected 2 or 3"
            )
    return TensorDict(source=decoded, batch_size=tuple(batch_size), device=device)
