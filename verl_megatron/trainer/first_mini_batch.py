"""``actor.old_log_probs_from_first_update`` on the trainer's side: how many first rows the actor's
update forward gives the old log-probs of, the old-log-prob pass that skips them, and rollout
correction (importance weights) of the other rows only; the actor computes the first rows'
weights from its forward (``meta_info[FIRST_UPDATE_IS]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.config import PPOConfig
from verl_megatron.trainer.ppo.rollout_correction import apply_rollout_correction
from verl_megatron.workers.actor import FIRST_UPDATE_IS

__all__ = ["first_rows_skipped", "first_update_rows", "rollout_correction"]


def first_update_rows(config: PPOConfig) -> int:
    """Rows 0..n-1 of a batch (its first mini-batch) whose old log-probs the actor's update forward
    gives (``actor.old_log_probs_from_first_update``); 0 when off."""
    actor = config.actor
    return actor.ppo_mini_batch_size * config.rollout.n if actor.old_log_probs_from_first_update else 0


def rollout_correction(batch: DataProto, config: PPOConfig) -> dict[str, float]:
    """``apply_rollout_correction``; with the option on, of the rows after the first mini-batch only
    (their ``rollout_corr/*`` metrics), NaN weights in the first rows and the IS settings in
    ``meta_info`` for the actor, which weighs those rows with its own forward's log-probs. Rejection
    sampling and batch-normalised weights are refused at start-up (trainer/validate.py)."""
    corr = config.algorithm.rollout_correction
    own = first_update_rows(config)
    if own == 0 or not corr.enabled or corr.bypass_mode:
        return apply_rollout_correction(batch, corr)
    tensors = batch.batch
    rest = batch.slice(own, None)
    metrics = apply_rollout_correction(rest, corr) if len(rest) else {}
    if corr.rollout_is is not None:
        weights = torch.full_like(tensors["old_log_probs"], float("nan"))
        if len(rest):
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
