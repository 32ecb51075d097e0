"""Streaming the actor's weights into a colocated inference engine, in bounded buckets.

The actor's megatron parameters are gathered across tp/pp one tensor at a time by
``verl_megatron.models.convert.iter_hf_weights`` (Hugging Face names and layouts, every rank
receives every tensor). This module turns that stream into what an engine's weight loader
takes: names mapped to the engine's (``rename``), tensors cast to the engine's dtype, and
grouped into buckets of at most ``max_bytes`` so that the extra memory held at any moment is
one bucket, not a second copy of the model. A tensor larger than a bucket travels alone (a
loader cannot take part of a tensor), so the peak is max(bucket, largest tensor).

With ``rollout.placement=separate`` the same buckets cross to the rollout ranks over a process
group (``WeightSender`` / ``receive_weights``): each bucket is one flat byte buffer plus a
header naming its tensors, sent without blocking the trainer (the buffers of one version stay
alive until the next version is sent, the rollout having taken them by then). On CPU (gloo)
the buffer is a host copy sent to each rollout rank in turn; given a ``broadcast`` group (NCCL,
over the sending rank and the rollout ranks, ``rollout/placement.py``) it stays on the device
and crosses in one broadcast, only the small per-bucket header going over the gloo group.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.wire import check_wire

__all__ = [
    "Message",
    "SyncStats",
    "WeightSender",
    "isend_object",
    "iter_buckets",
    "map_weights",
    "megabytes",
    "pack_bucket",
    "receive_weights",
    "recv_object",
    "rename",
    "stream_weights",
    "unpack_bucket",
]

NamedTensor = tuple[str, torch.Tensor]
Message = tuple[dist.Work, torch.Tensor]
"""A send in flight and the buffer it reads (kept alive until the send completes)."""


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


# ---------------------------------------------------------------- over a process group

WEIGHTS_TAG, OBJECT_TAG = 11, 12


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def pack_bucket(bucket: list[NamedTensor], on_host: bool = True) -> tuple[bytes, torch.Tensor]:
    """(header, payload): the tensors' bytes back to back, uint8 [total bytes], on the CPU (or,
    ``on_host=False``, on the tensors' own device), and their (name, dtype, shape)."""
    header = pickle.dumps([(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in bucket])
    flat = [t.detach().contiguous() for _, t in bucket]
    flat = [(t.cpu() if on_host else t).reshape(-1).view(torch.uint8) for t in flat]
    return header, torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Broadcast ``tensor`` from ``group``'s rank 0 (the sender), without waiting."""
    check_wire("weight broadcast", tensor)
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


def _send(group: dist.ProcessGroup, tensor: torch.Tensor, dst: int, tag: int) -> Message:
    check_wire("weight sync send", tensor)
    return group.send([tensor], dst, tag), tensor


def unpack_bucket(header: bytes, payload: torch.Tensor) -> list[NamedTensor]:
    """The (name, tensor) list ``pack_bucket`` packed; the tensors are views of ``payload``."""
    out, offset = [], 0
    for name, dtype_name, shape in pickle.loads(header):
        dtype = getattr(torch, dtype_name)
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        out.append((name, payload[offset : offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    if offset != payload.numel():
        raise ValueError(
            f"unpack_bucket: the header covers {offset} of the payload's {payload.numel()} bytes"
        )
    return out


class WeightSender:
    """Sends weight versions from one rank to ``dst_ranks`` of ``group``, bucketed, without blocking.

    Per bucket and destination: a [4] int64 message (version, header bytes, payload bytes, last
    bucket of the version), the header, the payload. With ``broadcast`` (a group whose rank 0 is
    this rank and whose others are ``dst_ranks``: NCCL on GPU) the payload instead goes once to
    all, on its device. A version's buffers stay referenced until the next ``send`` (or
    ``wait``) has seen them delivered.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        dst_ranks: list[int],
        bucket_megabytes: int | float,
        broadcast: dist.ProcessGroup | None = None,
    ) -> None:
        self.group, self.dst_ranks, self.broadcast = group, list(dst_ranks), broadcast
        self.max_bytes = megabytes(bucket_megabytes)
        self._pending: list[Message] = []

    def wait(self) -> None:
        """Block until every message sent so far has been received."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def send(self, weights: Iterable[NamedTensor], version: int) -> SyncStats:
        self.wait()
        stats = SyncStats()
        buckets = iter_buckets(weights, self.max_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            following = next(buckets, None)
            header, payload = pack_bucket(bucket, on_host=self.broadcast is None)
            meta = torch.tensor([version, len(header), payload.numel(), following is None], dtype=torch.int64)
            point_to_point = (meta, _as_bytes(header)) + ((payload,) if self.broadcast is None else ())
            for tensor in point_to_point:
                for dst in self.dst_ranks:
                    self._pending.append(_send(self.group, tensor, dst, WEIGHTS_TAG))
            if self.broadcast is not None:
                self._pending.append((_broadcast(self.broadcast, payload), payload))
            stats.tensors += len(bucket)
            stats.bytes += payload.numel()
            stats.buckets += 1
            stats.largest_bucket_bytes = max(stats.largest_bucket_bytes, payload.numel())
            bucket = following
        return stats


def _recv(group: dist.ProcessGroup, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    check_wire("weight sync receive", tensor)
    group.recv([tensor], src, tag).wait()
    return tensor


def receive_weights(
    group: dist.ProcessGroup,
    src: int,
    load: Callable[[list[NamedTensor]], None],
    broadcast: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> int:
    """Receive one version from ``src`` (see WeightSender), calling ``load`` per bucket; its number.

    ``broadcast``: the sender's broadcast group (NCCL), payloads arrive on ``device`` through it.
    """
    while True:
        version, header_len, payload_len, last = _recv(
            group, torch.empty(4, dtype=torch.int64), src, WEIGHTS_TAG
        )
        header = _recv(group, torch.empty(int(header_len), dtype=torch.uint8), src, WEIGHTS_TAG)
        if broadcast is None:
            payload = _recv(group, torch.empty(int(payload_len), dtype=torch.uint8), src, WEIGHTS_TAG)
        else:
            payload = torch.empty(int(payload_len), dtype=torch.uint8, device=device)
            _broadcast(broadcast, payload).wait()
        load(unpack_bucket(header.numpy().tobytes(), payload))
        if last:
            return int(version)


def isend_object(group: dist.ProcessGroup, obj: object, dst: int) -> list[Message]:
    """Send a picklable object without blocking; keep the returned (work, buffer) pairs until done."""
    data = _as_bytes(pickle.dumps(obj))
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [_send(group, t, dst, OBJECT_TAG) for t in (size, data)]


def recv_object(group: dist.ProcessGroup, src: int) -> Any:
    """The object ``isend_object`` sent from ``src`` (its type is the sender's)."""
    size = _recv(group, torch.empty(1, dtype=torch.int64), src, OBJECT_TAG)
    data = _recv(group, torch.empty(int(size), dtype=torch.uint8), src, OBJECT_TAG)
    return pickle.loads(data.numpy().tobytes())
