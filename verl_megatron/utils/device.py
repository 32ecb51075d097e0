"""The accelerator this process uses, under verl's names: CUDA when present, else the CPU."""

from __future__ import annotations

from types import ModuleType

import torch

__all__ = ["get_device_id", "get_device_name", "get_nccl_backend", "get_torch_device", "is_cuda_available"]


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def get_device_name() -> str:
    """``"cuda"`` or ``"cpu"``: the device type tensors of this process live on."""
    return "cuda" if is_cuda_available() else "cpu"


def get_torch_device() -> ModuleType:
    """``torch.cuda`` or ``torch.cpu`` (both offer ``is_available``, ``set_device``, ``current_device``)."""
    return torch.cuda if is_cuda_available() else torch.cpu


def get_device_id() -> int:
    """Index of the current device (always 0 on the CPU)."""
    return get_torch_device().current_device() if is_cuda_available() else 0


def get_nccl_backend() -> str:
    """The collective backend for this device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if is_cuda_available() else "gloo"
