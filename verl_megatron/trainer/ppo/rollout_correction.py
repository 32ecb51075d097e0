"""Rollout correction in the trainer's step (verl's decoupled mode), and its start-up checks.

After ``old_log_probs`` (the training policy before this step's update) is known, and before
advantages: log_ratio = old_log_probs - rollout_log_probs per token gives IS weights
(``rollout_is_weights``, which the actor's policy loss multiplies into the per-token loss, as
verl's losses do) and a rejection mask (rejected tokens leave ``response_mask``, so they count
neither in the advantages nor in the loss). Metrics are verl's ``rollout_corr/*``.
"""

from __future__ import annotations

from verl_megatron.algos.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo.rollout_correction_config import RolloutCorrectionConfig

__all__ = ["apply_rollout_correction"]


def apply_rollout_correction(batch: DataProto, config: RolloutCorrectionConfig) -> dict[str, float]:
    """Add ``rollout_is_weights`` [B, Tr] and apply the rejection to ``response_mask`` in place;
    return the ``rollout_corr/*`` metrics. Nothing happens (and {} returns) when the config
    enables neither IS nor rejection, or in bypass mode (there old_log_probs *are* the rollout's)."""
    if not config.enabled or config.bypass_mode:
        return {}
    tensors = batch.batch
    if "rollout_log_probs" not in tensors.keys():  # noqa: SIM118 (TensorDict has no __contains__)
        raise KeyError(
            "algorithm.rollout_correction is on but the rollout returned no rollout_log_probs "
            "(rollout.calculate_log_probs=true for vllm/sglang)"
        )
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=tensors["old_log_probs"],
        rollout_log_prob=tensors["rollout_log_probs"],
        response_mask=tensors["response_mask"],
        rollout_is=config.rollout_is,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize,
        rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold,
    )
    tensors["response_mask"] = mask
    if weights is not None:
        tensors["rollout_is_weights"] = weights.batch["rollout_is_weights"]
    return metrics
