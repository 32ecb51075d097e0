"""Pick the checkpoint to resume from: the newest one whose files are intact.

A damaged newest checkpoint (a file whose checksum, size or presence does not match its
marker, or a part whose marker is missing) is named in one warning line and the next older
one is tried; when none is intact, one error says which are damaged and how to choose a
checkpoint instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.storage import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["load_newest_intact"]

T = TypeVar("T")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_newest_intact(
    root: str | os.PathLike, load: Callable[[Path], T], say: Callable[[str], None]
) -> tuple[Path, T] | None:
    """``load(step_dir)`` of the newest complete checkpoint under ``root`` that loads intact.

    ``load`` must raise CheckpointCorruptError (and change nothing it cannot overwrite
    with the next try) when a checkpoint is damaged; it is collective, so every rank
    sees the same outcome and tries the same next one. Returns None when ``root``
    holds no committed checkpoint. Raises CheckpointNotFoundError when all are damaged.
    """
    steps = storage.complete_steps(root)
    # A committed step whose part marker is gone is damage like a bad checksum: named, then skipped.
    broken = storage.damaged_steps(root)
    damaged: list[str] = []
    for step in sorted(set(steps) | set(broken), reverse=True):
        if step in broken:
            damaged.append(f"{storage.step_dir(root, step).name} ({broken[step]})")
            continue
        path = steps[step]
        try:
            result = load(path)
        except CheckpointCorruptError as err:
            damaged.append(f"{path.name} ({_first_line(err)})")
            continue
        if damaged:
            say(f"warning: damaged checkpoint(s) skipped: {'; '.join(damaged)}; resuming from {path} instead")
        return path, result
    if damaged:
        raise CheckpointNotFoundError(
            f"no intact checkpoint under {root}: {'; '.join(damaged)}. Resume from a copy you trust with "
            "trainer.resume_mode=resume_path trainer.resume_from_path=<its global_step_N directory> "
            "once the damaged steps are moved out of this directory (or into another "
            "trainer.default_local_dir), or start over in another trainer.default_local_dir"
        )
    return None
