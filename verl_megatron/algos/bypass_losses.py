"""REINFORCE with rollout IS weights, and ``bypass_mode``: the policy loss used when the
trainer skips the old-log-prob pass and trains against the rollout policy directly
(see `rollout_corr_helper.apply_bypass_mode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_megatron.algos.aggregation import agg_loss
from verl_megatron.algos.policy_losses import (
    LossCall,
    LossResult,
    _metrics,
    _weighted,
    check_inputs,
    compute_policy_loss_vanilla,
    global_batch_kwargs,
    policy_loss,
)
from verl_megatron.utils.torch_functional import masked_mean

__all__ = ["compute_policy_loss_bypass_mode", "compute_policy_loss_reinforce"]

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: -A * log_prob per token, times the (detached) rollout IS weights when
    given; no ratio, no clip. actor/ppo_kl = masked mean of rollout_log_prob - log_prob."""
    if config is None:
        raise ValueError("compute_policy_loss_reinforce: the actor config is required (global batch counts)")
    check_inputs("reinforce", rollout_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    pg_losses = _weighted(-advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, **global_batch_kwargs(config, global_batch_info)
    )
    ppo_kl = masked_mean(rollout_log_prob - log_prob, response_mask)
    return pg_loss, _metrics(ppo_kl=ppo_kl)


def _setting(section: Any, name: str, default: Any) -> Any:
    if hasattr(section, "get"):
        return section.get(name, default)
    return getattr(section, name, default)


@policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(c: LossCall) -> LossResult:
    """Bypass mode: `old_log_prob` IS the rollout log-prob. IS weights (pi / pi_rollout)
    and the rejection mask come from config.policy_loss.rollout_correction (rollout_is,
    rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold);
    the given `rollout_is_weights` are ignored. loss_type "ppo_clip" (default) is vanilla
    PPO on the rejected mask without IS weights (the ratio already is pi / pi_rollout);
    "reinforce" is REINFORCE with the IS weights. Metrics include ``rollout_corr/*``."""
    from verl_megatron.algos.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if c.config is None:
        raise ValueError("bypass_mode: the actor config is required")
    corr = c.loss_setting("rollout_correction", None)
    if corr is None:
        raise ValueError(
            "bypass_mode: actor.policy_loss.rollout_correction is not set; "
            "apply_bypass_mode (or the trainer) must pass the rollout_correction config"
        )
    loss_type = _setting(corr, "loss_type", "ppo_clip")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    with torch.no_grad():
        proto, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=c.log_prob,
            rollout_log_prob=c.old_log_prob,
            response_mask=c.response_mask,
            rollout_is=_setting(corr, "rollout_is", None),
            rollout_is_threshold=_setting(corr, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=_setting(corr, "rollout_is_batch_normalize", False),
            rollout_rs=_setting(corr, "rollout_rs", None),
            rollout_rs_threshold=_setting(corr, "rollout_rs_threshold", None),
        )
    args = (c.old_log_prob, c.log_prob, c.advantages, mask, c.loss_agg_mode, c.config)
    if loss_type == "reinforce":
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        pg_loss, metrics = compute_policy_loss_reinforce(
            *args, weights, global_batch_info=c.global_batch_info
        )
    else:
        pg_loss, metrics = compute_policy_loss_vanilla(*args, None, global_batch_info=c.global_batch_info)
    return pg_loss, {**metrics, **corr_metrics}
