"""Reshaping and conversion helpers behind ``DataProto``'s verl-compatible methods.

Each function takes a ``DataProto`` and builds its result with ``type(data)(...)``, so subclasses
stay subclasses and this module needs no import of ``protocol``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from verl_megatron.errors import VerlCompatError
from verl_megatron.utils.tensordict_utils import get_tensordict, non_tensor_stack

if TYPE_CHECKING:
    from verl_megatron.protocol import DataProto

__all__ = [
    "describe",
    "fold_batch_dim",
    "from_tensordict",
    "sample_level_repeat",
    "to_tensordict",
    "unfold_batch_dim",
    "unfold_column_chunks",
]


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
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


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
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


def sample_level_repeat(data: DataProto, repeat_times: Any) -> DataProto:
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


def unfold_column_chunks(data: DataProto, n_split: int, split_keys: list[str] | None = None) -> DataProto:
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


def to_tensordict(data: DataProto) -> TensorDict:
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
    cls: type[DataProto], tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
) -> DataProto:
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


def describe(data: DataProto) -> str:
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


def merge_meta_info(metas: list[dict]) -> dict:
    """The ``meta_info`` of a concatenation: every part's keys, ``metrics`` gathered from all parts.

    Each part's ``metrics`` (one dict, or a list of dicts) is collected and turned into one dict of
    lists, key order from the first dict. Any other key that two parts hold must hold equal values.
    """
    from verl_megatron.utils.deep_equal import values_equal

    merged: dict = {}
    metrics: list[dict] = []
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key == "metrics":
                if value is not None:
                    metrics.extend(value if isinstance(value, list) else [value])
            elif key not in merged:
                merged[key] = value
            elif not values_equal(merged[key], value):
                raise VerlCompatError(
                    f"Conflicting values for meta_info key '{key}': part {i} has {_short(value)}, "
                    f"an earlier part has {_short(merged[key])}"
                )
    if metrics:
        merged["metrics"] = _dict_of_lists(metrics)
    return merged


def _dict_of_lists(dicts: list[dict]) -> dict[str, list]:
    out: dict[str, list] = {key: [] for key in dicts[0]}
    for i, entry in enumerate(dicts):
        if not isinstance(entry, dict):
            raise VerlCompatError(f"concat: metrics entry {i} is a {type(entry).__name__}, expected a dict")
        for key, value in entry.items():
            if key not in out:
                raise VerlCompatError(
                    f"concat: metric '{key}' (entry {i}) is missing from the first metrics dict {sorted(out)}"
                )
            out[key].append(value)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
