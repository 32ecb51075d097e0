"""A checkpoint part of plain named tensors, written and read by one process.

For state that lives on one rank only and is not a model shard: the weight versions an async
run's rollout still needs after a resume (``trainer/async_trainer.py``). One safetensors file
per entry; the part gets the same marker (sizes, sha256) as the model parts and is published
with its step, so a damaged file is named like any other damaged checkpoint file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.storage import CheckpointCorruptError

__all__ = ["load_tensor_part", "save_tensor_part"]


def save_tensor_part(
    root: str | os.PathLike, step: int, name: str, entries: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Stage part ``name`` of ``step`` holding ``entries`` (file stem -> named tensors); published
    by the step's commit. Not collective: call it on the one rank that holds the tensors."""
    from safetensors.torch import save_file

    tmp = storage.start_part(root, step, name)
    for stem, tensors in entries.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / f"{stem}.safetensors"))
    storage.publish_part(root, step, name, {"step": step, "name": name, "entries": sorted(entries)})


def load_tensor_part(step_dir: str | os.PathLike, name: str) -> dict[str, dict[str, torch.Tensor]] | None:
    """The entries of part ``name`` of a published step (None: the step has no such part).

    Raises CheckpointCorruptError naming the file when one is missing, truncated or altered."""
    from safetensors.torch import load_file

    part = Path(step_dir) / name
    if not part.is_dir():
        return None
    meta = storage.read_part_meta(part)  # sizes and checksums of every file
    try:
        return {stem: load_file(str(part / f"{stem}.safetensors")) for stem in meta["entries"]}
    except (OSError, KeyError, ValueError) as err:
        raise CheckpointCorruptError(f"checkpoint part {part} is unreadable: {err}") from err
