"""The trainer's side of the stall watchdog (``distributed/watchdog.py``): its settings from the
config, one watchdog per run, stopped and joined when the run ends however it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from verl_megatron.distributed.watchdog import Watchdog, WatchdogSettings, start_watchdog
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.config_schema import PPOConfig, TrainerConfig

__all__ = ["StageMarks", "process_group_minutes", "timed_stage", "watched"]


class StageMarks(Protocol):
    """What the step loop tells the watchdog: the stage it enters (progress, and what a stall line
    names)."""

    def mark(self, stage: str, step: int | None = None) -> None: ...


def timed_stage(
    stages: StageMarks | None, name: str, step: int, timing: dict[str, float]
) -> contextlib.AbstractContextManager[None]:
    """Time stage ``name`` of ``step`` into ``timing[name]``, telling ``stages`` (if any) that it starts."""
    if stages is not None:
        stages.mark(name, step)
    return M.timed(name, timing)


def process_group_minutes(trainer: TrainerConfig) -> float:
    """``trainer.process_group_timeout_s`` in the minutes that torch and megatron take."""
    return trainer.process_group_timeout_s / 60


def _load_cpu_kernels(config: PPOConfig) -> None:
    """Load (on a new machine: compile) the native engine's CPU decode kernels now, before the
    watchdog starts: a rank waiting for another process's compile of them (torch's file lock)
    shows no progress of its own, and on a loaded machine the compile outlasts a minute."""
    if config.rollout.name == "native" and not torch.cuda.is_available():
        from verl_megatron.rollout.cpu.kernels import decode_kernels

        decode_kernels()


@contextlib.contextmanager
def watched(config: PPOConfig, group: dist.ProcessGroup | None = None) -> Iterator[Watchdog | None]:
    """This rank's watchdog over ``group`` (default: the job) for the ``with`` block; None with one
    process or ``trainer.stall_timeout_s=0``. A collective: every rank of ``group`` enters together."""
    trainer = config.trainer
    world = 0 if not dist.is_initialized() else dist.get_world_size() if group is None else group.size()
    if trainer.stall_timeout_s > 0 and world > 1:  # one process has no watchdog
        _load_cpu_kernels(config)
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
