"""Prompt data: verl's row format, the chat-templated dataset, the resumable loader, generators."""

from verl_megatron.data.config import DataConfig
from verl_megatron.data.dataset import DataFormatError, PromptLoader, RLHFDataset, collate_prompts, read_rows

__all__ = ["DataConfig", "DataFormatError", "PromptLoader", "RLHFDataset", "collate_prompts", "read_rows"]
