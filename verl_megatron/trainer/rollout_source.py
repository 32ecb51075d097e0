"""Where the trainer's batches come from: the step calls its rollout source at two points.

    batch, metrics = source.next_batch(step, timing)   # the step's batch, scored
    old, arriving = source.old_log_probs(step, batch, compute)  # when recomputed
    ...reference, values, advantages, critic and actor updates (``arriving``'s rows taken in it)...
    source.after_update(step, timing)                  # the updated weights are out

plus ``start(step)`` once the run has resumed (0: a fresh start) and ``finish()`` after the last
step. A colocated run generates on its own ranks (``LocalRollout``, in ``ppo_trainer.py``);
``rollout.placement=separate`` receives its batches from the rollout ranks and sends them the
weights (``AsyncRolloutLink``, in ``async_trainer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from verl_megatron.protocol import DataProto

__all__ = ["ArrivingOldLogProbs", "LogProbFn", "RolloutSource", "ScoreFn"]

ScoreFn = Callable[[DataProto], dict[str, float]]
"""Scores a training batch in place (``token_level_scores`` and the extra info); returns the
counts of contained scorer failures."""

LogProbFn = Callable[[DataProto], torch.Tensor]
"""The actor's old-log-prob pass: [B, Tr] log-probs of a batch's response tokens."""


@dataclass(frozen=True)
class ArrivingOldLogProbs:
    """Old log-probs of a batch's rows ``first_row``.. that another rank computes and the actor's
    update takes when it needs them (``take`` waits for them: [B - first_row, Tr])."""

    first_row: int
    take: Callable[[], torch.Tensor]


class RolloutSource(Protocol):
    """The two calls of the step (and the two of the run) that differ between sync and async."""

    def start(self, step: int) -> None:
        """The run starts after step ``step`` (its checkpoint is loaded; 0: a fresh start)."""

    def next_batch(self, step: int, timing: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        """Step ``step``'s scored batch and its generation metrics; stage times go to ``timing``."""
        ...

    def old_log_probs(
        self, step: int, batch: DataProto, compute: LogProbFn
    ) -> tuple[torch.Tensor, ArrivingOldLogProbs | None]:
        """[B, Tr] old log-probs of step ``step``'s batch; ``compute`` is the actor's pass (a
        colocated run calls it on the whole batch, an async one may have rows computed elsewhere).
        With the second item, its rows are NaN here and arrive during the actor's update."""
        ...

    def after_update(self, step: int, timing: dict[str, float]) -> None:
        """Step ``step``'s updates are done."""

    def finish(self) -> None:
        """Every step has run (not called when the run fails)."""
