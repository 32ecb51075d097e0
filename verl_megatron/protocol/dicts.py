"""Dict-level helpers behind ``DataProto``: per-sample object arrays, unions and ``meta_info`` merging.

They work on TensorDicts, dicts and numpy arrays only, so ``protocol`` imports this module and
never the other way round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tensordict import TensorDict

from verl_megatron.errors import VerlCompatError
from verl_megatron.utils.deep_equal import values_equal

__all__ = [
    "check_keys",
    "merge_meta_info",
    "to_object_array",
    "union_dicts",
    "union_numpy_dict",
    "union_tensor_dict",
]


def to_object_array(key: str, values: Any) -> np.ndarray:
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


def union_dicts(name: str, dict1: dict, dict2: dict) -> dict:
    """Add the entries of ``dict2`` to ``dict1`` in place; a shared key must hold equal values."""
    for key, value in dict2.items():
        if key in dict1 and not values_equal(dict1[key], value):
            raise VerlCompatError(
                f"cannot union: {name} key '{key}' holds different values in the two DataProtos"
            )
        dict1[key] = value
    return dict1


def check_keys(kind: str, wanted: Iterable[str], available: Iterable[str]) -> list[str]:
    """``wanted`` as a list; KeyError naming the missing keys when some are not in ``available``."""
    wanted, available = list(wanted), list(available)
    missing = [k for k in wanted if k not in available]
    if missing:
        raise KeyError(f"{kind} keys {missing} not found; available: {sorted(available)}")
    return wanted


def merge_meta_info(metas: list[dict]) -> dict:
    """The ``meta_info`` of a concatenation: every part's keys, ``metrics`` gathered from all parts.

    Each part's ``metrics`` (one dict, or a list of dicts) is collected and turned into one dict of
    lists, key order from the first dict. Any other key that two parts hold must hold equal values.
    """
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
