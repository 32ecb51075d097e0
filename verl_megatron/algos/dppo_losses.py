"""Policy losses without a PPO ratio clip: DPPO (binary TV / binary KL trust regions,
arXiv:2602.04879) and DRO (a quadratic log-ratio penalty). Same call shape as the
losses in `policy_losses`.
"""

from __future__ import annotations

import torch

from verl_megatron.algos.policy_losses import (
    _MAX_LOG_RATIO,
    LossCall,
    LossResult,
    _metrics,
    policy_loss,
)
from verl_megatron.utils.torch_functional import masked_mean

__all__ = ["compute_policy_loss_dppo_kl", "compute_policy_loss_dppo_tv", "compute_policy_loss_dro"]

# DPPO truncates the (detached) ratio at clip_ratio_c instead of dual-clipping; a large
# cap keeps the truncation bias small. Used only when the config has no clip_ratio_c.
_DPPO_DEFAULT_RATIO_CAP = 20.0
# Keeps log(1 - p) finite for a token of probability 1 (verl's offset).
_BINARY_KL_EPS = 1e-8


def _dppo(name: str, c: LossCall) -> LossResult:
    """-A * sg(min(r, cap)) * log_prob on tokens inside the trust region (others get no gradient).

    The region is on the sampled token's probability p vs old p_old, bounded by
    clip_ratio_low/high (here divergence thresholds, not ratio ranges): for TV,
    p - p_old <= high (A > 0) and p - p_old >= -low (A <= 0); for KL, the binary KL
    between (p_old, 1 - p_old) and (p, 1 - p) <= high (A > 0, or p <= p_old) and
    <= low (A <= 0, or p >= p_old). pg_clipfrac = share of tokens outside;
    pg_clipfrac_lower = share inside whose ratio exceeds the cap (clip_ratio_c).
    """
    c.check(name)
    low, high = c.clip_ratios()
    log_ratio = torch.clamp(c.log_prob - c.old_log_prob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, c.response_mask)
    cap = float(c.setting("clip_ratio_c", _DPPO_DEFAULT_RATIO_CAP))
    truncated = torch.clamp(ratio, max=cap).detach()

    prob, old_prob = torch.exp(c.log_prob), torch.exp(c.old_log_prob)
    if name == "dppo_tv":
        inside_pos = (prob - old_prob) <= high
        inside_neg = (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (c.old_log_prob - c.log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + _BINARY_KL_EPS) / (1.0 - prob + _BINARY_KL_EPS)
        )
        inside_pos = (binary_kl <= high) | (prob <= old_prob)
        inside_neg = (binary_kl <= low) | (prob >= old_prob)
    inside = torch.where(c.advantages > 0, inside_pos, inside_neg).detach().to(c.log_prob.dtype)

    pg_loss = c.aggregate(-c.advantages * truncated * c.log_prob * inside)
    pg_clipfrac = masked_mean(1.0 - inside, c.response_mask)
    pg_clipfrac_lower = masked_mean((ratio > cap).to(c.log_prob.dtype) * inside, c.response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(c: LossCall) -> LossResult:
    """DPPO with the binary total-variation trust region (see `_dppo`)."""
    return _dppo("dppo_tv", c)


@policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(c: LossCall) -> LossResult:
    """DPPO with the binary KL trust region (see `_dppo`)."""
    return _dppo("dppo_kl", c)


@policy_loss("dro")
def compute_policy_loss_dro(c: LossCall) -> LossResult:
    """DRO: -(A * log_prob - beta / 2 * (log_prob - old_log_prob)^2) per token, beta =
    config.policy_loss.dro_beta (> 0, required). Metric: actor/ppo_kl only."""
    c.check("dro")
    beta = c.loss_setting("dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {beta!r}")
    log_ratio = c.log_prob - c.old_log_prob
    pg_loss = c.aggregate(-(c.log_prob * c.advantages - 0.5 * beta * log_ratio.square()))
    return pg_loss, _metrics(ppo_kl=masked_mean(-log_ratio, c.response_mask))
