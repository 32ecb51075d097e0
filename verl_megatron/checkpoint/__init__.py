"""Checkpoints of megatron models, optimizers and trainer state (dist-checkpointing, atomic on disk)."""

from verl_megatron.checkpoint.manager import commit_checkpoint, load_checkpoint, save_checkpoint
from verl_megatron.checkpoint.storage import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    find_latest_checkpoint,
    read_latest_pointer,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "commit_checkpoint",
    "find_latest_checkpoint",
    "load_checkpoint",
    "read_latest_pointer",
    "save_checkpoint",
]
