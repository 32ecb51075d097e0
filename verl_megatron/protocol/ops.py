"""Reshaping and conversion helpers behind ``DataProto``'s verl-compatible methods.

Each function takes a ``DataProto`` and builds its result with ``type(data)(...)``, so subclasses
stay subclasses. The functions are typed against ``Rows`` (the three fields a DataProto has), so
``data_proto`` imports this module and never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl_megatron.errors import VerlCompatError
from verl_megatron.utils.tensordict_utils import get_tensordict, non_tensor_stack

__all__ = [
    "Rows",
    "check_concat_keys",
    "describe",
    "fold_batch_dim",
    "from_tensordict",
    "repeat_rows",
    "row_index",
    "sample_level_repeat",
    "to_tensordict",
    "unfold_batch_dim",
    "unfold_column_chunks",
]


class Rows(Protocol):
    """What the functions here need of a ``DataProto``: the three fields, a length, and a
    constructor taking them by keyword (``type(data)(batch=..., non_tensor_batch=..., meta_info=...)``)."""

    batch: TensorDict | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    def __init__(
        self,
        batch: TensorDict | None = ...,
        non_tensor_batch: dict[str, np.ndarray] = ...,
        meta_info: dict[str, Any] = ...,
    ) -> None: ...

    def __len__(self) -> int: ...


R = TypeVar("R", bound=Rows)


def fold_batch_dim(data: R, new_batch_size: int) -> R:
    """Rows [B, ...] regrouped as [new_batch_size, B // new_batch_size, ...] (consecutive rows
    form a group); the batch size becomes ``new_batch_size``. ``data`` is left unchanged."""
    size = len(data)
    if new_batch_size <= 0 or size % new_batch_size != 0:
        raise VerlCompatError(f"fold_batch_dim: {size} rows do not fold into {new_batch_size} equal groups")
    batch = None
    if data.batch is not None:
        batch = data.batch.view(new_batch_size, -1)
        batch.auto_batch_size_(batch_dims=1)
    non_tensor = {k: v.reshape(new_batch_size, -1, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def unfold_batch_dim(data: R, batch_dims: int = 2) -> R:
    """Inverse of ``fold_batch_dim``: the first ``batch_dims`` dimensions become one batch dimension."""
    batch, size = None, None
    if data.batch is not None:
        batch = data.batch.clone(recurse=False)
        batch.auto_batch_size_(batch_dims=batch_dims)
        if len(batch.batch_size) != batch_dims:
            raise VerlCompatError(
                f"unfold_batch_dim: the tensors share only {len(batch.batch_size)} leading dims, "
                f"not {batch_dims}"
            )
        batch = batch.view(-1)
        size = batch.batch_size[0]
    non_tensor = {}
    for key, value in data.non_tensor_batch.items():
        rows = int(np.prod(value.shape[:batch_dims])) if size is None else size
        non_tensor[key] = value.reshape(rows, *value.shape[batch_dims:])
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def sample_level_repeat(data: R, repeat_times: Any) -> R:
    """Row ``i`` repeated ``repeat_times[i]`` times, in order (a list, tuple, array or 1-D tensor)."""
    if isinstance(repeat_times, torch.Tensor | np.ndarray) and repeat_times.ndim != 1:
        raise VerlCompatError(
            f"sample_level_repeat: repeat_times must be 1-D, got shape {tuple(repeat_times.shape)}"
        )
    if not isinstance(repeat_times, list | tuple | torch.Tensor | np.ndarray):
        raise VerlCompatError(
            f"sample_level_repeat: repeat_times must be a list, tuple, numpy array or tensor, "
            f"got {type(repeat_times).__name__}"
        )
    counts = torch.as_tensor(list(np.asarray(repeat_times).tolist()), dtype=torch.long).reshape(-1)
    if counts.numel() != len(data) or bool((counts < 0).any()):
        raise VerlCompatError(
            f"sample_level_repeat: need one non-negative count per row ({len(data)}), got {counts.tolist()}"
        )
    batch = None
    if data.batch is not None:
        source = {k: t.repeat_interleave(counts.to(t.device), dim=0) for k, t in data.batch.items()}
        batch = TensorDict(source=source, batch_size=(int(counts.sum()),), device=data.batch.device)
    non_tensor = {k: np.repeat(v, counts.numpy(), axis=0) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def row_index(idxs: list | np.ndarray | torch.Tensor, length: int) -> np.ndarray:
    """``idxs`` (integer indices or a bool mask over ``length`` rows) as a checked 1-D numpy array."""
    idxs_np = idxs.detach().cpu().numpy() if isinstance(idxs, torch.Tensor) else np.asarray(idxs)
    if idxs_np.size == 0:
        idxs_np = idxs_np.astype(np.int64)
    if idxs_np.ndim != 1 or idxs_np.dtype.kind not in "biu":
        raise TypeError(
            f"DataProto row index must be a 1-D integer or bool array, got {idxs_np.dtype} {idxs_np.shape}"
        )
    if idxs_np.dtype == bool and idxs_np.shape[0] != length:
        raise IndexError(f"bool mask has {idxs_np.shape[0]} entries but the DataProto has {length} rows")
    if idxs_np.dtype != bool and idxs_np.size and not (-length <= idxs_np.min() and idxs_np.max() < length):
        raise IndexError(f"indices {idxs_np.tolist()} out of range for a DataProto of length {length}")
    return idxs_np


def repeat_rows(data: R, repeat_times: int, interleave: bool) -> R:
    """Each row ``repeat_times`` times: ``[a, a, b, b]`` when interleaved, else ``[a, b, a, b]``."""
    if repeat_times <= 0:
        raise VerlCompatError(f"repeat: repeat_times must be positive, got {repeat_times}")
    batch = None
    if data.batch is not None:
        if interleave:
            source = {k: t.repeat_interleave(repeat_times, dim=0) for k, t in data.batch.items()}
        else:
            source = {k: t.repeat(repeat_times, *([1] * (t.dim() - 1))) for k, t in data.batch.items()}
        batch = TensorDict(source=source, batch_size=[len(data) * repeat_times], device=data.batch.device)
    non_tensor = {}
    for key, val in data.non_tensor_batch.items():
        if interleave:
            non_tensor[key] = np.repeat(val, repeat_times, axis=0)
        else:
            non_tensor[key] = np.tile(val, (repeat_times,) + (1,) * (val.ndim - 1))
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def check_concat_keys(parts: list[Rows]) -> None:
    """Raise unless every part has part 0's batch keys and non-tensor keys."""
    if not parts:
        raise VerlCompatError("concat: got an empty list of DataProto")
    first = parts[0]
    batch_keys = _batch_keys(first)
    for i, part in enumerate(parts[1:], start=1):
        keys = _batch_keys(part)
        if keys != batch_keys:
            raise VerlCompatError(
                f"concat: part {i} has batch keys {_sorted(keys)} but part 0 has {_sorted(batch_keys)}"
            )
        if part.non_tensor_batch.keys() != first.non_tensor_batch.keys():
            raise VerlCompatError(
                f"concat: part {i} has non_tensor keys {sorted(part.non_tensor_batch)} "
                f"but part 0 has {sorted(first.non_tensor_batch)}"
            )


def _batch_keys(data: Rows) -> set[str] | None:
    return set(data.batch.keys()) if data.batch is not None else None


def _sorted(keys: set[str] | None) -> list[str] | None:
    return sorted(keys) if keys is not None else None


def unfold_column_chunks(data: R, n_split: int, split_keys: list[str] | None = None) -> R:
    """Split dim 1 of each key in ``split_keys`` into ``n_split`` chunks laid out as new rows
    ([B, n*C, ...] -> [B*n, C, ...]); other keys repeat each row ``n_split`` times."""
    split = set(split_keys or [])
    known = set(data.batch.keys() if data.batch is not None else []) | set(data.non_tensor_batch)
    unknown = sorted(split - known)
    if unknown:
        raise KeyError(f"unfold_column_chunks: split_keys {unknown} not found; available: {sorted(known)}")

    def unfold(key: str, value: Any, repeat: Any) -> Any:
        if key not in split:
            return repeat(value)
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == object:
            value = _object_rows_as_columns(key, value)
        if value.ndim < 2 or value.shape[1] % n_split != 0:
            raise VerlCompatError(
                f"unfold_column_chunks: '{key}' of shape {tuple(value.shape)} cannot split dim 1 into {n_split}"
            )
        return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

    batch = None
    if data.batch is not None:
        source = {
            k: unfold(k, t, lambda x: x.repeat_interleave(n_split, dim=0)) for k, t in data.batch.items()
        }
        batch = TensorDict(source=source, batch_size=(len(data) * n_split,), device=data.batch.device)
    non_tensor = {
        k: unfold(k, v, lambda x: np.repeat(x, n_split, axis=0)) for k, v in data.non_tensor_batch.items()
    }
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=data.meta_info)


def _object_rows_as_columns(key: str, rows: np.ndarray) -> np.ndarray:
    """[B] object array of equal-length sequences -> [B, L] object array (one cell per element)."""
    lengths = {len(row) if isinstance(row, list | tuple | np.ndarray) else -1 for row in rows}
    if len(lengths) != 1 or -1 in lengths:
        raise VerlCompatError(
            f"unfold_column_chunks: '{key}' must hold sequences of one length per row to split, got lengths {lengths}"
        )
    table = np.empty((len(rows), lengths.pop()), dtype=object)
    for i, row in enumerate(rows):
        for j, item in enumerate(row):
            table[i, j] = item
    return table


def to_tensordict(data: R) -> TensorDict:
    """One TensorDict: tensors as they are, per-sample objects as ``NonTensorStack``, ``meta_info``
    entries as ``NonTensorData``. ``from_tensordict`` reverses it."""
    tensors: dict[str, Any] = dict(data.batch.items()) if data.batch is not None else {}
    clashes = sorted(set(tensors) & set(data.non_tensor_batch))
    if clashes:
        raise VerlCompatError(f"to_tensordict: keys {clashes} are in both batch and non_tensor_batch")
    for key, value in data.non_tensor_batch.items():
        tensors[key] = non_tensor_stack(value)
    return get_tensordict(tensor_dict=tensors, non_tensor_dict=data.meta_info)


def from_tensordict(
    cls: type[R], tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
) -> R:
    """A DataProto from a TensorDict built like ``to_tensordict``'s output."""
    if num_batch_dims != 1:
        raise VerlCompatError(
            f"from_tensordict: a DataProto has one batch dimension, got num_batch_dims={num_batch_dims}"
        )
    meta = dict(meta_info or {})
    tensors: dict[str, torch.Tensor] = {}
    non_tensor: dict[str, np.ndarray] = {}
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, NonTensorStack):
            array = np.empty(len(value), dtype=object)
            for i, item in enumerate(value.tolist()):
                array[i] = item
            non_tensor[key] = array
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        else:
            raise VerlCompatError(f"from_tensordict: '{key}' is a {type(value).__name__}; cannot place it")
    size = tensor_dict.batch_size[:1] if tensors else None
    batch = TensorDict(tensors, batch_size=size) if tensors else None
    return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


def describe(data: R) -> str:
    """A multi-line listing: each tensor's shape, dtype and device, each array's shape and dtype,
    and a type summary of each ``meta_info`` value (``list[int]``, ``dict[str: float]``, ...)."""
    lines = ["batch"]
    for key, tensor in data.batch.items() if data.batch is not None else []:
        lines.append(f"  {key}: {tuple(tensor.shape)} ({tensor.dtype}) {tensor.device}")
    lines.append("non_tensor_batch")
    lines += [
        f"  {key}: ndarray{array.shape} ({array.dtype})" for key, array in data.non_tensor_batch.items()
    ]
    lines.append("meta_info")
    lines += [f"  {key}: {_type_summary(value)}" for key, value in data.meta_info.items()]
    return "\n".join(lines)


def _type_summary(value: Any) -> str:
    if isinstance(value, list):
        # The first three elements stand for the list (sorted so the text is stable).
        kinds = sorted({_type_summary(v) for v in value[:3]})
        return f"list[{'|'.join(kinds) if kinds else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_summary(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        key, item = next(iter(value.items()))
        return f"dict[{_type_summary(key)}: {_type_summary(item)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__
