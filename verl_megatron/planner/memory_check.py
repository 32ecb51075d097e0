"""The trainer's start-up memory check (``trainer.memory_check``): the plan ``verl-megatron plan``
prints, made for the job about to start, before any process group exists or weights are loaded.

``error`` (default) stops a job whose planned peak on some rank exceeds one GPU's memory, with
one ``error:`` line (exit status 2) naming the rank, its phase, the peak, the GPU's size and the
biggest saving; ``warn`` prints the same line as a ``warning:`` and starts the job; ``off`` skips
the check. The GPU's size is ``trainer.memory_check_gpu_memory`` when set (``80GiB``), else the
total memory of this process's GPU. The check is skipped when there is nothing to compare or
plan: on a CPU with no size given, with an empty ``model.path`` (the quickstart writes its model
later), and in a process whose caller already started torch.distributed (the planner builds
each rank under its own fake process group).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.planner.command import parse_memory, plan_config

__all__ = ["MEMORY_CHECK_MODES", "check_memory", "device_memory_bytes", "does_not_fit_line"]

MEMORY_CHECK_MODES = ("error", "warn", "off")
GiB = 2**30


def device_memory_bytes() -> int | None:
    """Total memory of this process's GPU (``LOCAL_RANK``); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory)


def _gpu_bytes(setting: Any, device_bytes: int | None) -> int | None:
    if setting is None or str(setting).strip() == "":
        return device_bytes
    try:
        return parse_memory(str(setting))
    except ConfigError:
        raise ConfigError(
            f"trainer.memory_check_gpu_memory={setting!r}: expected a positive size such as 80GiB or 141GB"
        ) from None


def does_not_fit_line(plan: Any, source: str) -> str:
    """One line: where and when the peak exceeds the GPU, by how much, and the biggest saving."""
    worst, phase = plan.worst, plan.peak_phase
    saving = (
        f"; biggest saving: {plan.savings[0][0]} ({plan.savings[0][1] / GiB:.2f} GiB)" if plan.savings else ""
    )
    return (
        f"trainer.memory_check: this job does not fit: {worst.position.label()} needs "
        f"{plan.peak / GiB:.2f} GiB in the {phase} phase, more than the {plan.gpu_bytes / GiB:.2f} GiB "
        f"of one GPU ({source}){saving}. `verl-megatron plan` prints the whole plan; "
        "trainer.memory_check=warn starts it anyway"
    )


def check_memory(config: Any, world_size: int, device_bytes: int | None) -> str | None:
    """Plan ``config`` (a validated PPOConfig) on ``world_size`` GPUs of ``device_bytes`` (or
    ``trainer.memory_check_gpu_memory``). Returns None when it fits or no check runs, the
    ``warning:`` line under ``warn``; raises ConfigError (the one line) under ``error``."""
    import torch.distributed as dist

    trainer = config.trainer
    # YAML reads a bare `off` as false, which the str field holds as "False".
    mode = "off" if str(trainer.memory_check).lower() == "false" else trainer.memory_check
    if mode not in MEMORY_CHECK_MODES:
        raise ConfigError(f"trainer.memory_check={mode!r}; expected one of {MEMORY_CHECK_MODES}")
    gpu_bytes = _gpu_bytes(trainer.memory_check_gpu_memory, device_bytes)
    if mode == "off" or gpu_bytes is None or not config.model.path or dist.is_initialized():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's and the CPU layer's start-up notes
        plan = plan_config(config, world_size, gpu_bytes, savings=None)
    if plan.fits:
        return None
    given = trainer.memory_check_gpu_memory
    source = f"trainer.memory_check_gpu_memory={given}" if given else "this GPU's total memory"
    line = does_not_fit_line(plan, source)
    if mode == "error":
        raise ConfigError(line)
    return f"warning: {line}"
