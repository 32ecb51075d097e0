"""verl-megatron: RL post-training of LLMs on megatron-core with verl's trainer API."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["DataProto", "DataProtoFuture", "__version__"]

# verl code imports these from the package root (``from verl import DataProto``). They load on
# first use so that ``import verl_megatron`` (the CLI, config tools) does not pull in torch.
_LAZY = {"DataProto": "verl_megatron.protocol", "DataProtoFuture": "verl_megatron.protocol"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_megatron' has no attribute '{name}'")
