"""``async_training``: off-policy training with the rollout on its own ranks (``rollout.placement=separate``).

The rollout generates the batch of step s+1 while the trainer trains step s; every sample
records the weight version it was generated with, and ``max_staleness`` bounds how far behind
the trained policy those weights may be (see ``trainer/async_trainer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_megatron.errors import AsyncTrainingConfigError

__all__ = ["AsyncTrainingConfig", "AsyncTrainingConfigError"]


@dataclass
class AsyncTrainingConfig:
    """How far generation may run ahead of training (with ``rollout.placement=separate``)."""

    max_staleness: int = 0
    """Most weight versions a training batch may lag behind the policy it trains: the batch of
    step s is generated with weights of step >= s-1-max_staleness. 0: generation of step s waits
    for the update of step s-1 (disaggregated but on-policy); 1: one-step off-policy, the
    generation of step s+1 overlaps the training of step s."""
    partial_rollout: bool = False
    """A weight update that arrives while a batch is generated is loaded between decode segments
    and the rest of the responses continue with the new weights; each token records its version."""
    partial_rollout_segment: int = 8
    """Tokens decoded between two checks for new weights when ``partial_rollout`` is on."""
    old_log_probs_on_rollout: bool = False
    """The rollout ranks compute the old log-probs of the last rows of each batch (a share of
    ``old_log_probs_rollout_share``, by default rollout.world_size / (trainer dp +
    rollout.world_size): half with one rollout rank and one trainer replica; with
    ``actor.old_log_probs_from_first_update`` every row after the first mini-batch, which the
    trainer's update takes when it reaches them) while the trainer computes the others. They do
    it on their copy of the weights the trainer holds at that step, at the point where they would
    otherwise wait idle for those weights, with the actor's own log-prob code and micro-batching
    rules; the trainer's critical path loses that share of the pass. A row's value can differ from a one-rank pass only
    in float rounding (its micro-batch neighbours differ). Not with MoE routing replay, LoRA or
    rollout.bitwise_parity."""
    old_log_probs_rollout_share: float | None = None
    """With ``old_log_probs_on_rollout``: the fraction of each batch's rows (its last ones; with
    ``actor.old_log_probs_from_first_update``, of the rows after the first mini-batch) whose old
    log-probs the rollout ranks compute, in (0, 1]; None: rollout.world_size / (trainer dp +
    rollout.world_size), each rollout rank counted as one more replica of the pass, or with
    ``actor.old_log_probs_from_first_update`` 1.0 (the trainer's update takes the rollout's rows
    when it reaches its second mini-batch, so they are off its critical path). A fixed
    number, not one measured from the roles' idle times, so the rows each side computes (and a
    row's float rounding) do not depend on timing; choose it from the run's ``async/*`` times
    (``benchmarks/bench_async.py`` prints the roles' busy times)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise AsyncTrainingConfigError(
                f"async_training.max_staleness must be >= 0 (weight versions a batch may lag), got {self.max_staleness}"
            )
        if self.partial_rollout_segment < 1:
            raise AsyncTrainingConfigError(
                f"async_training.partial_rollout_segment must be >= 1, got {self.partial_rollout_segment}"
            )
        share = self.old_log_probs_rollout_share
        if share is not None and not self.old_log_probs_on_rollout:
            raise AsyncTrainingConfigError(
                "async_training.old_log_probs_rollout_share is set but async_training.old_log_probs_on_rollout "
                "is false (no old log-probs are computed on the rollout ranks)"
            )
        if share is not None and not 0 < share <= 1:
            raise AsyncTrainingConfigError(
                f"async_training.old_log_probs_rollout_share must be in (0, 1] (the rollout ranks' fraction of "
                f"each batch's rows), got {share}"
            )
