"""Rollout correction settings (verl's ``algorithm.rollout_correction`` section).

The rollout engine samples with one set of numbers and the trainer recomputes the same
tokens' log-probs with another; rollout correction decides what the loss does about the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RolloutCorrectionConfig"]


@dataclass
class RolloutCorrectionConfig:
    """verl's ``RolloutCorrectionConfig``, with the fields this trainer implements."""

    bypass_mode: bool = False
    """Skip the actor's old-log-prob forward pass and train against the rollout's own log-probs
    (``old_log_probs := rollout_log_probs``), saving one forward pass per step. Accepted only
    where the two are equal bit for bit: ``rollout.name=native`` with ``rollout.bitwise_parity=true``
    (otherwise the run stops at start-up). The ``rollout/logprob_diff/*`` metrics are then not
    computed (there is no recomputation to compare with); the parity tests check them instead."""
