"""``actor.old_log_probs_from_first_update`` on the trainer's side: how many first rows the actor's
update forward gives the old log-probs of, the old-log-prob pass that skips them, and rollout
correction (importance weights) of the other rows only; the actor computes the first rows'
weights from its forward (``meta_info[FIRST_UPDATE_IS]``). In an async run the rollout ranks'
rows then arrive during the update (``LateOldLogProbs``): the first mini-batch needs none of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.config import PPOConfig
from verl_megatron.trainer.ppo.rollout_correction import apply_rollout_correction
from verl_megatron.trainer.rollout_source import ArrivingOldLogProbs
from verl_megatron.trainer.stall import StageMarks, timed_stage
from verl_megatron.workers.actor import FIRST_UPDATE_IS
from verl_megatron.workers.batching import LateRows

__all__ = [
    "LateOldLogProbs",
    "first_rows_skipped",
    "first_update_rows",
    "pass_diff_metrics",
    "rollout_correction",
]


def first_update_rows(config: PPOConfig) -> int:
    """Rows 0..n-1 of a batch (its first mini-batch) whose old log-probs the actor's update forward
    gives (``actor.old_log_probs_from_first_update``); 0 when off."""
    actor = config.actor
    return actor.ppo_mini_batch_size * config.rollout.n if actor.old_log_probs_from_first_update else 0


def rollout_correction(batch: DataProto, config: PPOConfig, later: bool = False) -> dict[str, float]:
    """``apply_rollout_correction``; with the option on, of the rows after the first mini-batch only
    (their ``rollout_corr/*`` metrics), NaN weights in the first rows and the IS settings in
    ``meta_info`` for the actor, which weighs those rows with its own forward's log-probs. Rejection
    sampling and batch-normalised IS weights are refused at start-up (trainer/validate.py).
    ``later``: the other rows' old log-probs are still to come; their weights are NaN too (and no
    metrics) until a second call."""
    corr = config.algorithm.rollout_correction
    own = first_update_rows(config)
    if own == 0 or not corr.enabled or corr.bypass_mode:
        return apply_rollout_correction(batch, corr)
    tensors = batch.batch
    rest = batch.slice(own, None)
    metrics = apply_rollout_correction(rest, corr) if len(rest) and not later else {}
    if corr.rollout_is is not None:
        weights = torch.full_like(tensors["old_log_probs"], float("nan"))
        if len(rest) and not later:
            weights[own:] = rest.batch["rollout_is_weights"]
        tensors["rollout_is_weights"] = weights
        batch.meta_info[FIRST_UPDATE_IS] = {
            "rollout_is": corr.rollout_is,
            "rollout_is_threshold": corr.rollout_is_threshold,
        }
    return metrics


def first_rows_skipped(
    rows: int, compute: Callable[[DataProto], torch.Tensor]
) -> Callable[[DataProto], torch.Tensor]:
    """``compute`` for a batch whose first ``rows`` rows need no old log-probs (the actor takes them
    from its first mini-batch's update forward, ``actor.old_log_probs_from_first_update``): [B, Tr]
    with NaN in rows 0..rows-1 and ``compute``'s on the rest (not called when there is none)."""

    def skipped(batch: DataProto) -> torch.Tensor:
        rest = batch.slice(rows, None) if rows < len(batch) else None
        computed = compute(rest) if rest is not None else None
        width = batch.batch["responses"].shape[1]
        nan = torch.full((min(rows, len(batch)), width), float("nan"))
        if computed is None:
            return nan
        return torch.cat([nan.to(computed.device, computed.dtype), computed])

    return skipped


def pass_diff_metrics(batch: DataProto, first: int) -> dict[str, float]:
    """How far the rollout's log-probs are from the old-log-prob pass's, over rows ``first``.. (the
    ones the pass computed); {} when the rollout gave none."""
    tensors = batch.batch
    if "rollout_log_probs" not in tensors.keys():  # noqa: SIM118
        return {}
    rows = slice(first, None)
    return M.rollout_probs_diff_metrics(
        tensors["rollout_log_probs"][rows], tensors["old_log_probs"][rows], tensors["response_mask"][rows]
    )


class LateOldLogProbs:
    """Old log-probs that arrive during the actor's update (``arriving``: an async run's rollout
    ranks compute them once the step's weights reached them), with the option on.

    Until then their rows are NaN, and so are the IS weights of every row after the first
    mini-batch. ``rows()`` is the actor's ``LateRows``: when the second mini-batch is cut it takes
    them, then computes what the old-log-prob stage computes when nothing comes late (the pass's
    log-prob diff and rollout correction of the rows after the first mini-batch: the same values),
    the metrics kept for ``finish()``; its wait is stage ``wait_old_log_probs`` of step ``step``
    (``timing`` and ``stages``, the stall watchdog's marks: a stalled rollout is named as such, not as
    the update). ``finish()`` after the update takes them if the update did not (no actor update).
    """

    def __init__(
        self,
        batch: DataProto,
        config: PPOConfig,
        arriving: ArrivingOldLogProbs,
        timing: dict[str, float],
        stages: StageMarks | None = None,
        step: int = 0,
    ) -> None:
        self.batch, self.config, self.arriving = batch, config, arriving
        self.timing, self.stages, self.step = timing, stages, step
        self.own = first_update_rows(config)
        self.metrics: dict[str, float] | None = None
        rollout_correction(batch, config, later=True)

    def rows(self) -> LateRows:
        return LateRows(first_row=self.own, fetch=self._take_in_update)

    def _take_in_update(self) -> dict[str, torch.Tensor]:
        rows = self._take()
        if self.stages is not None:
            self.stages.mark("update_actor", self.step)  # back in the update that asked for them
        return rows

    def _take(self) -> dict[str, torch.Tensor]:
        tensors = self.batch.batch
        with timed_stage(self.stages, "wait_old_log_probs", self.step, self.timing):
            arrived = self.arriving.take()
        old = tensors["old_log_probs"]
        old[self.arriving.first_row :] = arrived.to(old.device, old.dtype)
        self.metrics = pass_diff_metrics(self.batch, self.own)
        self.metrics.update(rollout_correction(self.batch, self.config))
        keys = [k for k in ("old_log_probs", "rollout_is_weights") if k in tensors.keys()]  # noqa: SIM118
        return {k: tensors[k][self.own :] for k in keys}

    def finish(self) -> dict[str, float]:
        if self.metrics is None:
            self._take()
        assert self.metrics is not None
        return self.metrics
