"""The trainer's side of the stall watchdog (``distributed/watchdog.py``): its settings from the
config, one watchdog per run, stopped and joined when the run ends however it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch.distributed as dist

from verl_megatron.distributed.watchdog import Watchdog, WatchdogSettings, start_watchdog
from verl_megatron.trainer.config_schema import TrainerConfig

__all__ = ["StageMarks", "process_group_minutes", "watched"]


class StageMarks(Protocol):
    """What the step loop tells the watchdog: the stage it enters (progress, and what a stall line
    names)."""

    def mark(self, stage: str, step: int | None = None) -> None: ...


def process_group_minutes(trainer: TrainerConfig) -> float:
    """``trainer.process_group_timeout_s`` in the minutes that torch and megatron take."""
    return trainer.process_group_timeout_s / 60


@contextlib.contextmanager
def watched(trainer: TrainerConfig, group: dist.ProcessGroup | None = None) -> Iterator[Watchdog | None]:
    """This rank's watchdog over ``group`` (default: the job) for the ``with`` block; None with one
    process or ``trainer.stall_timeout_s=0``. A collective: every rank of ``group`` enters together."""
    watchdog = start_watchdog(WatchdogSettings(trainer.stall_timeout_s, trainer.default_local_dir), group)
    if watchdog is None:
        yield None
        return
    try:
        yield watchdog
    except BaseException as err:
        watchdog.stop(err)  # ends this rank here when the error is a peer's death
        raise
    watchdog.stop()
