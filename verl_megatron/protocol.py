"""The batch container passed between trainer stages, compatible with verl's ``DataProto``.

A ``DataProto`` holds three things about the same ``B`` samples:

- ``batch``: a ``TensorDict`` with ``batch_size == [B]`` (e.g. ``prompts`` [B, Tp], ``responses``
  [B, Tr], ``attention_mask`` [B, Tp+Tr]) or ``None`` when there are no tensors;
- ``non_tensor_batch``: a dict of numpy arrays (usually ``dtype=object``) whose first axis has
  length ``B`` (e.g. ``uid``, ``data_source``, ``reward_model``);
- ``meta_info``: a plain dict shared by the whole batch (e.g. ``temperature``).

User code written against ``verl.protocol`` ports by changing the import. Unlike verl, bad input
raises an error naming the offending key and sizes instead of a bare ``assert``; where verl
asserts, the error is a ``VerlCompatError`` (both ``ValueError`` and ``AssertionError``) so code
catching either keeps working.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from verl_megatron import protocol_ops
from verl_megatron.errors import VerlCompatError
from verl_megatron.protocol_future import DataProtoFuture
from verl_megatron.protocol_ops import fold_batch_dim, unfold_batch_dim
from verl_megatron.utils.deep_equal import values_equal
from verl_megatron.utils.tensor_serde import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)

__all__ = [
    "DataProto",
    "DataProtoFuture",
    "DataProtoItem",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

# meta_info key that lets ``chunk`` split into unequal parts (verl's name, so flags set by verl
# code carry over).
AUTO_PADDING_KEY = "_verl_auto_padding"

Index = int | np.integer | slice | list | np.ndarray | torch.Tensor


def _to_object_array(key: str, values: Any) -> np.ndarray:
    """Wrap a sequence as a 1-D object array of ``len(values)`` elements.

    ``np.array(list_of_lists, dtype=object)`` would build a 2-D array when the inner lists have
    equal lengths; filling element by element keeps one entry per sample.
    """
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(
            f"non_tensor '{key}' must be a numpy array or a sequence with one entry per sample, "
            f"got {type(values).__name__}"
        )
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` in place and return it.

    Raises VerlCompatError when the batch sizes differ or a shared key holds different values.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise VerlCompatError(
            f"cannot union batches of different sizes: {list(tensor_dict1.batch_size)} "
            f"and {list(tensor_dict2.batch_size)}"
        )
    # TensorDict iterates over rows, not keys, so go through items() and an explicit key set.
    existing_keys = set(tensor_dict1.keys())
    for key, value in tensor_dict2.items():
        if key not in existing_keys:
            tensor_dict1[key] = value
        elif not values_equal(tensor_dict1[key], value):
            raise VerlCompatError(
                f"cannot union: batch key '{key}' holds different values in the two DataProtos"
            )
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add the arrays of ``tensor_dict2`` to ``tensor_dict1`` in place and return it.

    A key in both must hold equal arrays (NaN equals NaN, object arrays compared element by element).
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            for name, array in (("tensor_dict1", tensor_dict1[key]), ("tensor_dict2", value)):
                if not isinstance(array, np.ndarray):
                    raise VerlCompatError(
                        f"union_numpy_dict: `{key}` in {name} is a {type(array).__name__}, not a numpy array"
                    )
            if not values_equal(tensor_dict1[key], value):
                raise VerlCompatError(f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = value
    return tensor_dict1


def _union_dicts(name: str, dict1: dict, dict2: dict) -> dict:
    """Add the entries of ``dict2`` to ``dict1`` in place; a shared key must hold equal values."""
    for key, value in dict2.items():
        if key in dict1 and not values_equal(dict1[key], value):
            raise VerlCompatError(
                f"cannot union: {name} key '{key}' holds different values in the two DataProtos"
            )
        dict1[key] = value
    return dict1


def _check_keys(kind: str, wanted: Iterable[str], available: Iterable[str]) -> list[str]:
    wanted, available = list(wanted), list(available)
    missing = [k for k in wanted if k not in available]
    if missing:
        raise KeyError(f"{kind} keys {missing} not found; available: {sorted(available)}")
    return wanted


@dataclass
class DataProtoItem:
    """One sample of a ``DataProto``: ``batch`` has ``batch_size == []`` and each
    ``non_tensor_batch`` value is the sample's own entry."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of ``B`` samples: tensors in ``batch`` [B, ...], numpy arrays in ``non_tensor_batch``
    [B, ...] and batch-wide values in ``meta_info``. See the module docstring."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors [B, ...] (all with the same first dimension) and per-sample values.

        ``non_tensors`` values may be numpy arrays or sequences (converted to 1-D object arrays).
        ``num_batch_dims`` exists for verl's signature: a DataProto has exactly one batch dimension
        (see ``fold_batch_dim`` for grouped rows). ``auto_padding`` lets ``chunk`` split unequally.
        """
        tensors = dict(tensors or {})
        if num_batch_dims != 1 and (tensors or non_tensors):
            raise VerlCompatError(
                f"from_dict: a DataProto has one batch dimension, got num_batch_dims={num_batch_dims}"
            )
        meta_info = dict(meta_info or {})
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
        batch_size: int | None = None
        pivot_key = None
        for key, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"tensors['{key}'] must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dim() == 0:
                raise VerlCompatError(
                    f"tensors['{key}'] is a scalar; batch tensors need a batch dimension [B, ...]"
                )
            if batch_size is None:
                batch_size, pivot_key = tensor.shape[0], key
            elif tensor.shape[0] != batch_size:
                raise VerlCompatError(
                    f"tensor '{key}' has {tensor.shape[0]} rows but tensor '{pivot_key}' has {batch_size}"
                )
        non_tensor_batch = {key: _to_object_array(key, val) for key, val in (non_tensors or {}).items()}
        batch = TensorDict(source=tensors, batch_size=[batch_size]) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls,
        data: dict[str, torch.Tensor | np.ndarray],
        meta_info: dict | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from one dict, sending tensors to ``batch`` and numpy arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, np.ndarray):
                non_tensors[key] = val
            else:
                raise TypeError(
                    f"from_single_dict: '{key}' must be a torch.Tensor or numpy.ndarray, got {type(val).__name__}"
                )
        return cls.from_dict(
            tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding
        )

    def check_consistency(self) -> None:
        """Raise if ``batch`` is not 1-D batched or any ``non_tensor_batch`` entry has the wrong length."""
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise TypeError(
                    f"DataProto.batch must be a TensorDict or None, got {type(self.batch).__name__}"
                )
            if len(self.batch.batch_size) != 1:
                raise VerlCompatError(
                    f"DataProto.batch must have one batch dimension [B], got batch_size {list(self.batch.batch_size)}"
                )
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(
                f"DataProto.non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}"
            )
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"DataProto.meta_info must be a dict, got {type(self.meta_info).__name__}")

        reference_name, reference_len = None, None
        if self.batch is not None:
            reference_name, reference_len = "batch", self.batch.batch_size[0]
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise TypeError(
                    f"non_tensor '{key}' must be a numpy array (dtype=object), got {type(val).__name__}"
                )
            if val.ndim == 0:
                raise VerlCompatError(f"non_tensor '{key}' is a 0-d array; it needs one entry per sample")
            if reference_len is None:
                reference_name, reference_len = f"non_tensor '{key}'", val.shape[0]
            elif val.shape[0] != reference_len:
                raise VerlCompatError(
                    f"non_tensor '{key}' has {val.shape[0]} rows but {reference_name} has {reference_len}"
                )

    # ------------------------------------------------------------------ size and indexing
    def __len__(self) -> int:
        if self.batch is not None:
            return self.batch.batch_size[0]
        if self.non_tensor_batch:
            return next(iter(self.non_tensor_batch.values())).shape[0]
        return 0

    def __getitem__(self, item: Index) -> DataProtoItem | DataProto:
        """``data[i]`` gives a ``DataProtoItem``; a slice, index list/array/tensor or bool mask gives a
        ``DataProto`` sharing ``meta_info``."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, list | np.ndarray | torch.Tensor):
            return self.select_idxs(item)
        if isinstance(item, int | np.integer) and not isinstance(item, bool):
            size = len(self)
            if not -size <= item < size:
                raise IndexError(f"index {item} is out of range for a DataProto of length {size}")
            batch = self.batch[int(item)] if self.batch is not None else None
            non_tensor = {key: val[item] for key, val in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)
        raise TypeError(f"DataProto indexing with {type(item).__name__} is not supported")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step`` as a new DataProto (tensors are views)."""
        s = slice(start, end, step)
        batch = self.batch[s] if self.batch is not None else None
        non_tensor = {key: val[s] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def select_idxs(self, idxs: list | np.ndarray | torch.Tensor) -> DataProto:
        """Rows at integer indices, or where a bool mask of length B is True, as a new DataProto."""
        idxs_np = idxs.detach().cpu().numpy() if isinstance(idxs, torch.Tensor) else np.asarray(idxs)
        if idxs_np.size == 0:
            idxs_np = idxs_np.astype(np.int64)
        if idxs_np.ndim != 1 or idxs_np.dtype.kind not in "biu":
            raise TypeError(
                f"DataProto row index must be a 1-D integer or bool array, got {idxs_np.dtype} {idxs_np.shape}"
            )
        if idxs_np.dtype == bool and idxs_np.shape[0] != len(self):
            raise IndexError(
                f"bool mask has {idxs_np.shape[0]} entries but the DataProto has {len(self)} rows"
            )
        if (
            idxs_np.dtype != bool
            and idxs_np.size
            and not (-len(self) <= idxs_np.min() and idxs_np.max() < len(self))
        ):
            raise IndexError(f"indices {idxs_np.tolist()} out of range for a DataProto of length {len(self)}")
        idxs_torch = torch.from_numpy(idxs_np)
        batch = None
        if self.batch is not None:
            new_size = int(idxs_np.sum()) if idxs_np.dtype == bool else idxs_np.shape[0]
            source = {key: tensor[idxs_torch.to(tensor.device)] for key, tensor in self.batch.items()}
            batch = TensorDict(source=source, batch_size=[new_size], device=self.batch.device)
        non_tensor = {key: val[idxs_np] for key, val in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    # ------------------------------------------------------------------ key operations
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A new DataProto with only the given keys (``None`` keeps all of that kind).

        Without ``deepcopy`` the tensors and objects are shared with ``self``; with it they are copied.
        """
        batch = self.batch
        if batch_keys is not None:
            if batch is None:
                raise KeyError(
                    f"select: batch keys {list(batch_keys)} requested but the DataProto has no batch"
                )
            batch = batch.select(*_check_keys("batch", batch_keys, batch.keys()))
        elif batch is not None:
            batch = batch.select(*batch.keys())  # a new TensorDict, so adding keys leaves self alone
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            keys = _check_keys("non_tensor_batch", non_tensor_batch_keys, non_tensor.keys())
            non_tensor = {key: non_tensor[key] for key in keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {key: meta[key] for key in _check_keys("meta_info", meta_info_keys, meta.keys())}
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor, meta = copy.deepcopy(non_tensor), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=dict(meta))

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from ``self`` and return them as a new DataProto."""
        batch_keys = _check_keys(
            "batch", batch_keys or [], self.batch.keys() if self.batch is not None else []
        )
        nt_keys = _check_keys("non_tensor_batch", non_tensor_batch_keys or [], self.non_tensor_batch.keys())
        meta_keys = _check_keys("meta_info", meta_info_keys or [], self.meta_info.keys())
        tensors = {key: self.batch.pop(key) for key in batch_keys}
        non_tensors = {key: self.non_tensor_batch.pop(key) for key in nt_keys}
        meta = {key: self.meta_info.pop(key) for key in meta_keys}
        return type(self).from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

    def rename(
        self, old_keys: str | list[str] | None = None, new_keys: str | list[str] | None = None
    ) -> DataProto:
        """Rename ``batch`` keys in place (only the tensor batch, as in verl) and return ``self``."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise VerlCompatError(f"rename: got {len(old)} old keys but {len(new)} new keys")
        if not old:
            return self
        if self.batch is None:
            raise KeyError(f"rename: keys {old} requested but the DataProto has no batch")
        _check_keys("batch", old, self.batch.keys())
        kept = set(self.batch.keys()) - set(old)
        clashes = sorted(kept.intersection(new))
        if clashes or len(set(new)) != len(new):
            raise VerlCompatError(
                f"rename: new keys {new} collide with each other or with existing keys {clashes}"
            )
        # Pop everything first so that swaps such as (a, b) -> (b, a) work.
        values = [self.batch.pop(key) for key in old]
        for key, value in zip(new, values):
            self.batch[key] = value
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other`` into ``self`` in place and return ``self``.

        Raises VerlCompatError if the lengths differ or a key present in both holds different values.
        """
        if not self._is_empty() and not other._is_empty() and len(self) != len(other):
            raise VerlCompatError(
                f"cannot union a DataProto of length {len(self)} with one of length {len(other)}"
            )
        if self.batch is None:
            batch = other.batch
        elif other.batch is None:
            batch = self.batch
        else:
            batch = union_tensor_dict(self.batch, other.batch)
        non_tensor = _union_dicts("non_tensor_batch", dict(self.non_tensor_batch), other.non_tensor_batch)
        meta = _union_dicts("meta_info", dict(self.meta_info), other.meta_info)
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor, meta
        self.check_consistency()
        return self

    def _is_empty(self) -> bool:
        return self.batch is None and not self.non_tensor_batch

    # ------------------------------------------------------------------ splitting and joining
    def is_padding_enabled(self) -> bool:
        """True when this DataProto was built with ``auto_padding=True`` (``chunk`` may split unequally)."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False))

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first row (``"first"``) or else the last row, in place."""
        if padding_size <= 0:
            return
        row = self.select_idxs([0 if padding_candidate == "first" else len(self) - 1])
        padded = DataProto.concat([self, row.repeat(padding_size)])
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts along the batch dimension; each keeps ``meta_info``.

        With auto-padding enabled the length need not divide: parts hold ceil(B / chunks) rows as
        ``torch.chunk`` does, and trailing parts may be shorter or empty.
        """
        if chunks <= 0:
            raise VerlCompatError(f"chunk: chunks must be positive, got {chunks}")
        if len(self) % chunks != 0 and not self.is_padding_enabled():
            raise VerlCompatError(
                f"chunk: DataProto of length {len(self)} is not divisible into {chunks} equal chunks"
            )
        size = -(-len(self) // chunks)
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive parts of ``split_size`` rows (the last one may be shorter)."""
        if split_size <= 0:
            raise VerlCompatError(f"split: split_size must be positive, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Join along the batch dimension; all parts need the same keys.

        ``meta_info`` is merged: every part's keys (equal values where parts share a key) and the
        parts' ``metrics`` gathered into one dict of lists (see ``protocol_ops.merge_meta_info``).
        """
        if not data:
            raise VerlCompatError("concat: got an empty list of DataProto")
        first = data[0]
        batch_keys = set(first.batch.keys()) if first.batch is not None else None
        for i, part in enumerate(data[1:], start=1):
            keys = set(part.batch.keys()) if part.batch is not None else None
            if keys != batch_keys:
                raise VerlCompatError(
                    f"concat: part {i} has batch keys {_sorted(keys)} but part 0 has {_sorted(batch_keys)}"
                )
            if part.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise VerlCompatError(
                    f"concat: part {i} has non_tensor keys {sorted(part.non_tensor_batch)} "
                    f"but part 0 has {sorted(first.non_tensor_batch)}"
                )
        batch = torch.cat([part.batch for part in data], dim=0) if batch_keys is not None else None
        non_tensor = {
            key: np.concatenate([part.non_tensor_batch[key] for part in data], axis=0)
            for key in first.non_tensor_batch
        }
        meta_info = protocol_ops.merge_meta_info([part.meta_info for part in data])
        return type(first)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``[a, a, b, b]`` when interleaved, else ``[a, b, a, b]``."""
        if repeat_times <= 0:
            raise VerlCompatError(f"repeat: repeat_times must be positive, got {repeat_times}")
        batch = None
        if self.batch is not None:
            if interleave:
                source = {k: t.repeat_interleave(repeat_times, dim=0) for k, t in self.batch.items()}
            else:
                source = {k: t.repeat(repeat_times, *([1] * (t.dim() - 1))) for k, t in self.batch.items()}
            batch = TensorDict(source=source, batch_size=[len(self) * repeat_times], device=self.batch.device)
        non_tensor = {}
        for key, val in self.non_tensor_batch.items():
            if interleave:
                non_tensor[key] = np.repeat(val, repeat_times, axis=0)
            else:
                non_tensor[key] = np.tile(val, (repeat_times,) + (1,) * (val.ndim - 1))
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=self.meta_info)

    def reorder(self, indices: torch.Tensor | np.ndarray | list[int]) -> None:
        """Reorder rows in place so that new row ``i`` is old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """Move ``batch`` to ``device`` in place and return ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def sample_level_repeat(self, repeat_times: list[int] | tuple | np.ndarray | torch.Tensor) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, rows kept in order."""
        return protocol_ops.sample_level_repeat(self, repeat_times)

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Dim 1 of ``split_keys`` cut into ``n_split`` new rows each; other keys repeated to match."""
        return protocol_ops.unfold_column_chunks(self, n_split, split_keys)

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: dict | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes over the data, each sharing
        ``meta_info``. Rows come in order unless ``dataloader_kwargs`` asks ``shuffle=True`` (then
        ``seed`` fixes the order). ``len(self)`` must be a multiple of ``mini_batch_size``."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size != 0:
            raise VerlCompatError(
                f"make_iterator: {len(self)} rows are not a multiple of mini_batch_size={mini_batch_size}"
            )
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        # A DataLoader over row indices gives torch's sampling order (same as iterating a dataset).
        loader = DataLoader(
            range(len(self)), batch_size=mini_batch_size, generator=generator, **(dataloader_kwargs or {})
        )

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                for idxs in loader:
                    yield self.select_idxs(idxs)

        return batches()

    # ------------------------------------------------------------------ conversion and storage
    def to_tensordict(self) -> TensorDict:
        """Everything in one TensorDict (objects as ``NonTensorStack``, meta as ``NonTensorData``)."""
        return protocol_ops.to_tensordict(self)

    @classmethod
    def from_tensordict(
        cls, tensor_dict: TensorDict, meta_info: dict | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """Inverse of ``to_tensordict``."""
        return protocol_ops.from_tensordict(cls, tensor_dict, meta_info, num_batch_dims)

    def get_data_info(self) -> str:
        """Keys with shapes, dtypes and devices, and the types of ``meta_info`` values, one per line."""
        return protocol_ops.describe(self)

    def __getstate__(self) -> tuple:
        # Tensors travel as raw numpy buffers (no torch.save, no TensorDict consolidation).
        batch = self.batch
        if batch is not None and all(isinstance(v, torch.Tensor) for v in batch.values()):
            batch = serialize_tensordict(batch)
        return batch, self.non_tensor_batch, self.meta_info

    def __setstate__(self, state: tuple | dict) -> None:
        if isinstance(state, dict):  # pickled before __getstate__ existed: the plain attribute dict
            state = (state.get("batch"), state.get("non_tensor_batch", {}), state.get("meta_info", {}))
        batch, non_tensor_batch, meta_info = state
        if isinstance(batch, tuple):
            batch_size, device, items = batch
            if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
                device = "cpu"  # a batch saved on a GPU host still opens on a CPU-only one
            batch = deserialize_tensordict((batch_size, device, items))
        self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Pickle to ``filepath`` (a trusted-file format: ``load_from_disk`` runs pickle)."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike) -> DataProto:
        """Load a DataProto written by ``save_to_disk``; only open files you trust (pickle)."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"load_from_disk: '{filepath}' holds a {type(data).__name__}, not a DataProto")
        return data


def _sorted(keys: set[str] | None) -> list[str] | None:
    return sorted(keys) if keys is not None else None


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append copies of the leading rows so that ``len`` becomes a multiple of ``size_divisor``.

    Returns ``(padded, pad_size)``; ``unpad_dataproto(padded, pad_size)`` undoes it.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"pad_dataproto_to_divisor expects a DataProto, got {type(data).__name__}")
    if size_divisor <= 0:
        raise VerlCompatError(f"size_divisor must be positive, got {size_divisor}")
    length = len(data)
    if length == 0 or length % size_divisor == 0:
        return data, 0
    pad_size = size_divisor - length % size_divisor
    # Wrap around the data as many times as needed: the pad can be longer than the data itself.
    padding = [data.slice(0, min(length, pad_size - start)) for start in range(0, pad_size, length)]
    return DataProto.concat([data, *padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows added by ``pad_dataproto_to_divisor``."""
    if not 0 <= pad_size <= len(data):
        raise VerlCompatError(f"pad_size {pad_size} must be between 0 and the DataProto length {len(data)}")
    return data if pad_size == 0 else data.slice(0, len(data) - pad_size)
