"""Reach the bare model inside the wrappers distributed training puts around it.

Megatron's DistributedDataParallel and Float16Module (and torch's DDP) keep the
wrapped model under ``.module``; a chunk may be wrapped more than once.
"""

from __future__ import annotations

import torch


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Return the innermost module of ``chunk``, following ``.module`` links."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
