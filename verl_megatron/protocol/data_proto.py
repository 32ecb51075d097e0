"""``DataProto`` and ``DataProtoItem``: the batch container (see the package docstring) and its padding helpers."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from verl_megatron.errors import VerlCompatError
from verl_megatron.protocol import ops as protocol_ops
from verl_megatron.protocol.dicts import (
    check_keys,
    merge_meta_info,
    to_object_array,
    union_dicts,
    union_tensor_dict,
)
from verl_megatron.utils.tensor_serde import deserialize_tensordict, serialize_tensordict

__all__ = ["AUTO_PADDING_KEY", "DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"]

# meta_info key that lets ``chunk`` split into unequal parts (verl's name, so flags set by verl
# code carry over).
AUTO_PADDING_KEY = "_verl_auto_padding"

Index = int | np.integer | slice | list | np.ndarray | torch.Tensor


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
        non_tensor_batch = {key: to_object_array(key, val) for key, val in (non_tensors or {}).items()}
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
        idxs_np = protocol_ops.row_index(idxs, len(self))
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
            batch = batch.select(*check_keys("batch", batch_keys, batch.keys()))
        elif batch is not None:
            batch = batch.select(*batch.keys())  # a new TensorDict, so adding keys leaves self alone
        non_tensor = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            keys = check_keys("non_tensor_batch", non_tensor_batch_keys, non_tensor.keys())
            non_tensor = {key: non_tensor[key] for key in keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            meta = {key: meta[key] for key in check_keys("meta_info", meta_info_keys, meta.keys())}
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
        batch_keys = check_keys(
            "batch", batch_keys or [], self.batch.keys() if self.batch is not None else []
        )
        nt_keys = check_keys("non_tensor_batch", non_tensor_batch_keys or [], self.non_tensor_batch.keys())
        meta_keys = check_keys("meta_info", meta_info_keys or [], self.meta_info.keys())
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
        check_keys("batch", old, self.batch.keys())
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
        non_tensor = union_dicts("non_tensor_batch", dict(self.non_tensor_batch), other.non_tensor_batch)
        meta = union_dicts("meta_info", dict(self.meta_info), other.meta_info)
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
        parts' ``metrics`` gathered into one dict of lists (see ``dicts.merge_meta_info``).
        """
        protocol_ops.check_concat_keys(data)
        first = data[0]
        batch = torch.cat([part.batch for part in data], dim=0) if first.batch is not None else None
        non_tensor = {
            key: np.concatenate([part.non_tensor_batch[key] for part in data], axis=0)
            for key in first.non_tensor_batch
        }
        meta_info = merge_meta_info([part.meta_info for part in data])
        return type(first)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``[a, a, b, b]`` when interleaved, else ``[a, b, a, b]``."""
        return protocol_ops.repeat_rows(self, repeat_times, interleave)

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
