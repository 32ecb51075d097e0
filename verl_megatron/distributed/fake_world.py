"""One rank of a job of any size, built without its devices or its peers (for memory planning).

:func:`fake_runtime` starts torch's fake process-group backend (every collective returns at
once, nothing is sent) at a chosen rank of a world of the chosen size, builds megatron's
parallel state for the layout on it exactly as :func:`~verl_megatron.distributed.parallel.init_runtime`
does, and yields the :class:`Runtime` of that rank. Inside :func:`meta_device`, megatron's
builders put every parameter, gradient buffer and optimizer copy on the ``meta`` device:
shapes and dtypes as the real job has them, no memory. Leaving either context destroys what
it created (the groups, megatron's state, the process group).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from verl_megatron.distributed import cpu_compat
from verl_megatron.distributed.parallel import (
    ParallelLayout,
    Runtime,
    build_megatron_groups,
    destroy_megatron_groups,
)

__all__ = ["fake_runtime", "meta_device"]


def _is_accelerator(device: Any) -> bool:
    # An int device index means "cuda:<index>" to torch factories.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda" if isinstance(device, (str, torch.device)) else False


class _MetaDeviceMode(TorchFunctionMode):
    """Sends every tensor meant for the GPU to the meta device, and names meta floats as CUDA
    floats for the ``tensor.type()`` checks by which megatron's optimizers sort parameters."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0].to("meta")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.meta.", "torch.cuda.")
        placed = dict(kwargs or {})
        if _is_accelerator(placed.get("device")):
            placed["device"] = "meta"
        placed.pop("pin_memory", None)  # pinned host memory needs a CUDA driver; meta needs none
        moves = func in (torch.Tensor.to, torch.Tensor.new_empty)
        if moves and len(args) > 1 and _is_accelerator(args[1]):
            args = (args[0], "meta", *args[2:])
        return func(*args, **placed)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Build on the meta device: default-device factories and every GPU placement land there."""
    with torch.device("meta"), _MetaDeviceMode():
        yield


def _new_group_without_gloo(new_group: Any) -> Any:
    # megatron also builds gloo groups (for checkpoint gathers); the fake backend stands in for
    # them, as a real gloo group cannot start without its peers.
    def make(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "gloo":
            kwargs = {**kwargs, "backend": None}
        return new_group(*args, **kwargs)

    return make


@contextlib.contextmanager
def fake_runtime(layout: ParallelLayout, world_size: int, rank: int, seed: int = 0) -> Iterator[Runtime]:
    """The :class:`Runtime` of ``rank`` in a ``world_size`` job laid out as ``layout``, on the fake backend.

    Needs a process without a process group (the fake one becomes the default group while the
    context lasts). Raises ParallelConfigError when the layout does not fit ``world_size``.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_runtime needs a process without a torch.distributed process group")
    layout = layout.resolve(world_size)
    cpu_compat.install()  # a no-op with CUDA; megatron's CUDA-only calls need it without
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    new_group = dist.new_group
    try:
        dist.new_group = _new_group_without_gloo(new_group)
        try:
            build_megatron_groups(layout)
        finally:
            dist.new_group = new_group
        yield Runtime(
            layout=layout,
            rank=rank,
            world_size=world_size,
            local_rank=0,
            device=torch.device("meta"),
            backend="fake",
            seed=seed,
        )
    finally:
        destroy_megatron_groups()
        dist.destroy_process_group()
