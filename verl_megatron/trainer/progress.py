"""What a user sees while a run starts and trains: a start-up line, then the step counter with an ETA.

``startup_line`` summarises the run in one line (model, layout, data, steps, output dir),
printed on rank 0 before the process group and the model are built, so the first seconds
are not silent. ``StepClock`` numbers the per-step console lines ``step 3/150`` and adds
the time left, measured from the steps run so far; on a terminal the tracker also draws a
rich progress bar, and in a log file (stdout not a terminal) these plain lines are all.

Imports nothing heavy: the start-up line is printed before torch is loaded where possible.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["DataSizes", "StepClock", "format_duration", "kept_weights_note", "startup_line"]


@dataclass(frozen=True)
class DataSizes:
    """Rows found in the data files (before over-long prompts are filtered)."""

    train_rows: int
    val_rows: int


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _layout(layout: Any, world_size: int) -> str:
    parts = [f"tp={layout.tp}", f"pp={layout.pp}"]
    if getattr(layout, "vpp", None):
        parts.append(f"vpp={layout.vpp}")
    parts += [f"cp={layout.cp}", f"dp={layout.dp}"]
    if getattr(layout, "ep", 1) > 1:
        parts.append(f"ep={layout.ep}")
    noun = "process" if world_size == 1 else "processes"
    return f"{' '.join(parts)} ({world_size} {noun})"


def _steps(config: Any, data: DataSizes | None) -> str:
    trainer = config.trainer
    if trainer.total_training_steps is not None:
        return f"{trainer.total_training_steps} steps"
    if data is None:
        return f"{trainer.total_epochs} epochs"
    per_epoch = data.train_rows // config.data.train_batch_size
    # Rows, not prompts: over-long prompts are filtered later, so this is an upper bound.
    return f"up to {trainer.total_epochs * per_epoch} steps ({trainer.total_epochs} epochs of {per_epoch})"


def startup_line(config: Any, layout: Any, world_size: int, data: DataSizes | None) -> str:
    """One line: model, parallel layout, data, batch, steps, output directory."""
    if config.model.path:
        model = config.model.path
    else:
        qs = config.quickstart
        family = "qwen2_5_vl" if qs.task == "shapes" else qs.family  # the shapes task's model is a VLM
        model = f"quickstart tiny {family} ({qs.num_layers} layers, hidden {qs.hidden_size})"
    if data is None:
        rows = f"synthetic '{config.quickstart.task}' task"
    else:
        rows = f"{data.train_rows} train / {data.val_rows} val rows"
    batch = f"batch {config.data.train_batch_size} prompts x {config.rollout.n} samples"
    return (
        f"verl-megatron train: model {model} | {config.model.dtype} | {_layout(layout, world_size)} | "
        f"{rows}, {batch} | {_steps(config, data)} | output {config.trainer.default_local_dir}"
    )


def kept_weights_note(config: Any) -> str | None:
    """A start-up line when the run will keep no weights (no checkpoints, no final export): verl's
    defaults, easy to inherit into a long run; None otherwise."""
    trainer = config.trainer
    if trainer.save_freq > 0 or trainer.export_hf:
        return None
    return (
        f"verl-megatron train: note: trainer.save_freq={trainer.save_freq} and trainer.export_hf=false, so this "
        "run keeps no weights; set trainer.save_freq=N (checkpoints) or trainer.export_hf=true (the final model)"
    )


class StepClock:
    """Step counter and time left for the per-step console lines.

    Args:
        total_steps: the run's last step.
        start_step: steps already done (a resumed run), not timed by this clock.
        clock: seconds, monotonic (a test passes a fake one).
    """

    def __init__(self, total_steps: int | None, start_step: int = 0, clock=time.monotonic) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self._clock = clock
        self._started = clock()

    def eta(self, step: int) -> float | None:
        """Seconds left after ``step``: the mean time of this run's steps times the steps left."""
        done = step - self.start_step
        if not self.total_steps or done < 1:
            return None
        return (self._clock() - self._started) / done * (self.total_steps - step)

    def prefix(self, step: int) -> str:
        """``step 3/150 (eta 1m50s)``; ``step 3`` when the run's length is unknown."""
        if not self.total_steps:
            return f"step {step}"
        eta = self.eta(step)
        left = "" if eta is None or step >= self.total_steps else f" (eta {format_duration(eta)})"
        return f"step {step}/{self.total_steps}{left}"
