"""The divergence guard: stop a run whose weights or loss blew up, before its checkpoint is published.

A learning rate a million times too large does not crash a run: every step "succeeds",
the weights become noise and the run exits 0 with a destroyed model in its checkpoints.
After each step the trainer asks ``DivergenceGuard.check``; it raises ``TrainingDivergedError``
(a clear message, a non-zero exit) when

- the actor's weights hold a NaN/inf, or their norm grew by more than
  ``max_weight_growth`` times in one step (Adam moves every weight by about ``lr`` a step,
  whatever the gradient, so a huge ``lr`` shows here at the first step), or
- ``max_nonfinite_steps`` steps in a row skipped actor optimizer steps for a non-finite
  loss or gradient norm (a rare one is skipped and the run goes on).

The step's checkpoint is staged but not yet published when the guard runs, so it is never
published: the earlier checkpoints stay the newest. The guard leaves ``diverged.json`` (step and
message) in the output dir: a torchrun restart would resume exactly and diverge again at the same
step, so it stops instead (``trainer_checkpoint.restarted``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DivergenceGuard",
    "DivergenceGuardConfig",
    "TrainingDivergedError",
    "divergence_marker",
    "global_weight_norm",
]


@dataclass
class DivergenceGuardConfig:
    """When to stop a run that blew up.

    Attributes:
        enable: check after every training step.
        max_weight_growth: stop when the actor's weight norm grows by more than this factor
            in one step (the quickstart's 40 first steps at lr 1e-3 grow it by at most 1.0016x
            a step; lr 1e6 by 2.6e7x); <= 0 disables.
        max_nonfinite_steps: stop after this many consecutive steps that skipped actor
            optimizer steps (non-finite loss or gradient norm); <= 0 disables.
    """

    enable: bool = True
    max_weight_growth: float = 4.0
    max_nonfinite_steps: int = 3


class TrainingDivergedError(RuntimeError):
    """The divergence guard stopped the run."""


def divergence_marker(output_dir: str | Path) -> Path:
    """The file the guard leaves in a run's output dir when it stops the run."""
    return Path(output_dir) / "diverged.json"


def _sum_of_squares(params: list[torch.Tensor], device: torch.device, exact: bool) -> torch.Tensor:
    """Sum of the squared entries of ``params``: a float64 scalar on ``device``, no host sync.

    One norm per tensor (``torch._foreach_norm``, float32 for 16/32-bit weights: no float64 copy
    of any weight), squared and summed in float64. A float32 norm overflows past ~1.8e19;
    ``exact`` computes every norm in float64 instead (slow, for weights that already overflowed).
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param in params:
        groups.setdefault((param.device, param.dtype), []).append(param)
    for (_, dtype), group in groups.items():
        wide = exact or dtype == torch.float64
        norms = (
            [torch.linalg.vector_norm(p, dtype=torch.float64) for p in group]
            if wide and dtype != torch.float64
            else torch._foreach_norm(group, 2, dtype=None if wide else torch.float32)
        )
        total += torch.stack(norms).double().square().sum().to(device)
    return total


def global_weight_norm(chunks: list[torch.nn.Module]) -> float:
    """L2 norm over every parameter of the model (collective over all ranks when distributed).

    Parameters replicated across ranks (data-parallel copies, norms under tensor parallelism)
    are counted once per copy: the value is a fixed multiple of the true norm for a given
    layout, which is all a growth ratio needs. The distributed optimizer's pending parameter
    all-gather (``overlap_param_gather``) is completed first, so every rank reads this update's
    weights. One host sync per call.
    """
    import torch.distributed as dist

    from verl_megatron.models.megatron_model import gather_updated_params

    gather_updated_params(chunks)
    params = [param.detach() for chunk in chunks for param in chunk.parameters()]
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:  # the all-reduce's device: NCCL moves GPU tensors, gloo CPU ones
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    else:
        device = params[0].device if params else torch.device("cpu")
    for exact in (False, True):
        total = _sum_of_squares(params, device, exact)
        if distributed:
            dist.all_reduce(total)
        norm = math.sqrt(float(total))
        # Every rank holds the same total: all of them recompute together, or none. Only a float32
        # overflow is worth a float64 pass; a NaN stays NaN.
        if not math.isinf(norm):
            break
    return norm


class DivergenceGuard:
    """Tracks the actor's weight norm and skipped steps across training steps."""

    def __init__(self, config: DivergenceGuardConfig, lr: float, marker: Path | None = None) -> None:
        """``marker``: where to leave the step and message of a divergence (one rank's), or None."""
        self.config = config
        self.lr = lr
        self.marker = marker
        self._norm: float | None = None
        self._nonfinite_run = 0

    def start(self, chunks: list[torch.nn.Module]) -> None:
        """Record the weight norm before the first step of this run (after any resume)."""
        if self.config.enable:
            self._norm = global_weight_norm(chunks)

    def check(self, step: int, metrics: dict[str, float], chunks: list[torch.nn.Module]) -> None:
        """Raise TrainingDivergedError when ``step`` blew the model up (collective)."""
        cfg = self.config
        if not cfg.enable:
            return
        norm = global_weight_norm(chunks)
        hint = (
            f"actor.optim.lr={self.lr:g}; the checkpoints saved before this step are kept. "
            "Lower the learning rate, or tune trainer.divergence_guard"
        )
        if not math.isfinite(norm):
            raise self._stop(
                step, f"training diverged at step {step}: the actor's weights hold NaN/inf ({hint})"
            )
        previous, self._norm = self._norm, norm
        if cfg.max_weight_growth > 0 and previous and norm > cfg.max_weight_growth * previous:
            raise self._stop(
                step,
                f"training diverged at step {step}: the actor's weight norm grew {norm / previous:.3g}x "
                f"in one step ({previous:.4g} -> {norm:.4g}; trainer.divergence_guard.max_weight_growth="
                f"{cfg.max_weight_growth:g}) ({hint})",
            )
        skipped = metrics.get("actor/skipped_steps", 0.0) > 0
        self._nonfinite_run = self._nonfinite_run + 1 if skipped else 0
        if 0 < cfg.max_nonfinite_steps <= self._nonfinite_run:
            raise self._stop(
                step,
                f"training diverged at step {step}: {self._nonfinite_run} steps in a row had a non-finite "
                f"loss or gradient norm (trainer.divergence_guard.max_nonfinite_steps="
                f"{cfg.max_nonfinite_steps}) ({hint})",
            )

    def _stop(self, step: int, message: str) -> TrainingDivergedError:
        """The error to raise, once ``marker`` records it."""
        if self.marker is not None:
            self.marker.write_text(json.dumps({"step": step, "error": message}))
        return TrainingDivergedError(message)
