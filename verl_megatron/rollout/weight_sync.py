"""Streaming the actor's weights into a colocated inference engine, in bounded buckets.

The actor's megatron parameters are gathered across tp/pp one tensor at a time by
``verl_megatron.models.convert.iter_hf_weights`` (Hugging Face names and layouts, every rank
receives every tensor). This module turns that stream into what an engine's weight loader
takes: names mapped to the engine's (``rename``), tensors cast to the engine's dtype, and
grouped into buckets of at most ``max_bytes`` so that the extra memory held at any moment is
one bucket, not a second copy of the model. A tensor larger than a bucket travels alone (a
loader cannot take part of a tensor), so the peak is max(bucket, largest tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["SyncStats", "iter_buckets", "map_weights", "megabytes", "rename", "stream_weights"]

NamedTensor = tuple[str, torch.Tensor]


def megabytes(mb: int | float) -> int:
    """Bytes in ``mb`` MiB (verl's ``update_weights_bucket_megabytes`` counts 2**20 bytes)."""
    if mb <= 0:
        raise ValueError(f"bucket size must be positive, got {mb} MB")
    return int(mb * 2**20)


def rename(name: str, name_map: dict[str, str]) -> str:
    """``name`` with its longest matching prefix in ``name_map`` replaced (unchanged when none matches).

    Engines that load Hugging Face checkpoints (vLLM, SGLang) take HF names as they are; the map
    covers engines or model classes whose parameter names differ by a prefix.
    """
    best = max((prefix for prefix in name_map if name.startswith(prefix)), key=len, default=None)
    return name if best is None else name_map[best] + name[len(best) :]


def map_weights(
    weights: Iterable[NamedTensor], name_map: dict[str, str] | None = None, dtype: torch.dtype | None = None
) -> Iterator[NamedTensor]:
    """Rename (see :func:`rename`) and cast each (name, tensor) lazily; the input order is kept."""
    name_map = name_map or {}
    for name, tensor in weights:
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield rename(name, name_map), tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(weights: Iterable[NamedTensor], max_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive (name, tensor) pairs grouped into lists of at most ``max_bytes`` in total.

    Order is kept; a tensor larger than ``max_bytes`` forms a bucket of its own. Duplicate names
    raise ValueError (a loader would silently keep only one of them).
    """
    if max_bytes <= 0:
        raise ValueError(f"iter_buckets: max_bytes must be positive, got {max_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise ValueError(f"iter_buckets: weight '{name}' appears twice in the stream")
        seen.add(name)
        nbytes = _nbytes(tensor)
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


@dataclass
class SyncStats:
    """What one weight sync moved."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    largest_bucket_bytes: int = 0


def stream_weights(
    weights: Iterable[NamedTensor],
    load: Callable[[list[NamedTensor]], None],
    *,
    bucket_megabytes: int | float,
    name_map: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> SyncStats:
    """Map, cast and bucket ``weights``, calling ``load(bucket)`` for each bucket in order.

    ``weights`` is consumed to the end (``iter_hf_weights`` is collective: every rank must
    finish it). Each bucket is released before the next one is built.
    """
    stats = SyncStats()
    for bucket in iter_buckets(map_weights(weights, name_map, dtype), megabytes(bucket_megabytes)):
        size = sum(_nbytes(t) for _, t in bucket)
        load(bucket)
        stats.tensors += len(bucket)
        stats.bytes += size
        stats.buckets += 1
        stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, size)
        # Drop this bucket before the generator gathers the next one: peak = one bucket.
        del bucket
    return stats
