"""Prompt data: verl's row format, the chat-templated dataset, the resumable loader, generators.

The dataset names load on first use: ``verl_megatron.data.config`` (read by the config
loader and by ``--help``) must not pull torch in.
"""

from typing import Any

from verl_megatron.data.config import DataConfig

__all__ = [
    "DataConfig",
    "DataFileNotFoundError",
    "DataFormatError",
    "PromptLoader",
    "RLHFDataset",
    "check_data_files",
    "collate_prompts",
    "read_rows",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from verl_megatron.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'verl_megatron.data' has no attribute {name!r}")
