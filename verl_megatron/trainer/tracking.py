"""Where metrics go: console lines with a progress bar, a JSONL file, TensorBoard, wandb, a PNG curve.

``Tracking`` lives on rank 0 only (other ranks get one with ``enabled=False``,
which does nothing). The JSONL file ``metrics.jsonl`` is always written, one
object per step with ``"step"`` and every metric; when a run resumes from step
``k`` the lines past ``k`` (logged by the interrupted run after its last
checkpoint) are dropped, so the file is one consistent history.

The file is only ever appended to or replaced whole (temporary file, fsync,
``os.replace``): a run killed at any moment leaves the old history or the new
one, never an empty or half-rewritten file. A line cut short by a kill in the
middle of an append is skipped when the file is read.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_megatron.trainer.progress import StepClock

__all__ = ["TRACKING_BACKENDS", "Tracking", "plot_curves", "read_jsonl_metrics"]

TRACKING_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")

# The handful of numbers worth a glance on the console; everything is in the JSONL file.
_CONSOLE_KEYS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/entropy",
    "critic/vf_loss",
    "actor/grad_norm",
    "train/loss",  # SFT (trainer/sft_trainer.py)
    "timing_s/step",
)


def _as_float(value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def read_jsonl_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """Every step's metrics from a ``metrics.jsonl`` file, in file order.

    A last line without its newline is what a kill in the middle of an append
    leaves: it is dropped. Any other unreadable line is an error naming it.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as err:
            if number == len(lines):  # the unterminated last line
                break
            raise ValueError(f"{path}, line {number}: not a JSON object ({err})") from err
    return rows


def _replace_file(path: str, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: a reader (or a kill) sees the old or the new file."""
    from verl_megatron.checkpoint.storage import write_text_atomic

    write_text_atomic(Path(path), text)


class Tracking:
    """Log one dict of metrics per step to the configured backends.

    Args:
        project_name, experiment_name: run names (wandb project/run, TensorBoard folder).
        backends: any of ``TRACKING_BACKENDS``; ``jsonl`` is always on.
        log_dir: folder for ``metrics.jsonl``, ``tensorboard/`` and ``curves.png``.
        config: the full config as a plain dict (sent to wandb, saved as ``config.json``).
        total_steps: length of the progress bar.
        resume_step: drop JSONL lines logged after this step (None: start a new file).
        enabled: False on every rank but 0.
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        backends: list[str],
        log_dir: str,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        resume_step: int | None = None,
        enabled: bool = True,
    ) -> None:
        unknown = sorted(set(backends) - set(TRACKING_BACKENDS))
        if unknown:
            raise ValueError(
                f"trainer.logger: unknown backend(s) {unknown}; known: {list(TRACKING_BACKENDS)}"
            )
        self.enabled = enabled
        self.backends = set(backends) | {"jsonl"}
        self.log_dir = log_dir
        self.jsonl_path = os.path.join(log_dir, "metrics.jsonl")
        self._tb = self._wandb = self._progress = self._task = None
        self._clock = StepClock(total_steps, resume_step or 0)
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if config is not None:
            _replace_file(os.path.join(log_dir, "config.json"), json.dumps(config, indent=2, default=str))
        self._start_jsonl(resume_step)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard", project_name, experiment_name))
        if "wandb" in self.backends:
            self._wandb = self._start_wandb(project_name, experiment_name, config)
        if "console" in self.backends and total_steps:
            self._start_progress(total_steps, resume_step or 0)

    def _start_jsonl(self, resume_step: int | None) -> None:
        if not os.path.exists(self.jsonl_path):
            _replace_file(self.jsonl_path, "")
            return
        rows = read_jsonl_metrics(self.jsonl_path)
        kept = [] if resume_step is None else [m for m in rows if m.get("step", 0) <= resume_step]
        with open(self.jsonl_path, "rb") as f:
            whole_lines = f.read().endswith(b"\n") or os.path.getsize(self.jsonl_path) == 0
        if len(kept) == len(rows) and whole_lines:
            return  # nothing to drop: the file is appended to as it is
        # Rewritten whole and swapped in atomically: a kill here must not cost the history.
        _replace_file(self.jsonl_path, "".join(json.dumps(m) + "\n" for m in kept))

    @staticmethod
    def _start_wandb(project: str, experiment: str, config: Mapping[str, Any] | None) -> Any:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "trainer.logger includes 'wandb' but wandb is not installed: pip install 'verl-megatron[wandb]'"
            ) from err
        return wandb.init(project=project, name=experiment, config=dict(config or {}))

    def _start_progress(self, total_steps: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # Only a live terminal gets the bar; in a log file it would be noise.
        if not sys.stdout.isatty():
            return
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[score]}"),
            # Redrawn at each step's line, not by a thread waking 10 times a second: that thread's
            # CPU time, ~10 ms a second, is noise in a rank's CPU use (the stall watchdog's measure).
            auto_refresh=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=done, score="")
        self._progress.start()

    def print(self, message: str) -> None:
        """A console message (above the progress bar when there is one)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Record ``data`` as the metrics of ``step``."""
        if not self.enabled:
            return
        metrics = {name: _as_float(value) for name, value in data.items()}
        with open(self.jsonl_path, "a", encoding="utf-8") as f:
            # One write per line, flushed to disk: a crash loses at most the line being written.
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.backends:
            self._console(metrics, step)

    def _console(self, metrics: Mapping[str, float], step: int) -> None:
        shown = [k for k in _CONSOLE_KEYS if k in metrics] + sorted(
            k for k in metrics if k.startswith("val/")
        )
        parts = [f"{k}={_fmt(metrics[k])}" for k in shown]
        self.print(f"{self._clock.prefix(step)}: " + "  ".join(parts))
        if self._progress is not None:
            score = metrics.get("critic/score/mean")
            self._progress.update(
                self._task,
                completed=step,
                score="" if score is None else f"score {score:.3f}",
                refresh=True,
            )

    def finish(self, plot: bool = True) -> str | None:
        """Close the backends; draw ``curves.png`` from the JSONL file. Returns the PNG path."""
        if not self.enabled:
            return None
        self.close()
        if not plot:
            return None
        return plot_curves(self.jsonl_path, os.path.join(self.log_dir, "curves.png"))

    def close(self) -> None:
        """Stop the progress bar (the terminal gets its cursor back) and close the TensorBoard and
        wandb writers, ending their threads; nothing is drawn. A run that fails calls this too;
        a second call does nothing. Messages still print, as plain lines."""
        progress, tb, run = self._progress, self._tb, self._wandb
        self._progress = self._tb = self._wandb = None
        if progress is not None:
            progress.stop()
        if tb is not None:
            tb.close()
        if run is not None:
            run.finish()


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def plot_curves(jsonl_path: str, png_path: str) -> str | None:
    """Reward (train score and validation scores) and response length against step, as a PNG."""
    rows = read_jsonl_metrics(jsonl_path) if os.path.exists(jsonl_path) else []
    if not rows:
        return None
    try:
        import matplotlib
    except ImportError:  # e.g. a GPU box given only the wheels it lacks (benchmarks/gpu/prepare_wheels.sh)
        print(f"matplotlib is not installed: no {png_path} (the metrics are in {jsonl_path})")
        return None

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    fig, (ax_reward, ax_len) = plt.subplots(1, 2, figsize=(11, 4))
    keys = ["critic/score/mean", *sorted({k for r in rows for k in r if k.startswith("val/test_score/")})]
    for key in keys:
        steps, values = series(key)
        if steps:
            ax_reward.plot(steps, values, marker="o" if key.startswith("val/") else None, label=key)
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("reward")
    ax_reward.legend(fontsize=8)
    ax_reward.grid(alpha=0.3)
    steps, values = series("response_length/mean")
    ax_len.plot(steps, values, label="response_length/mean")
    ax_len.set_xlabel("step")
    ax_len.set_ylabel("tokens")
    ax_len.legend(fontsize=8)
    ax_len.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
