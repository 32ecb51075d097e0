"""Clip-Cov and KL-Cov policy losses (arXiv:2505.22617, "The Entropy Mechanism of RL").

Both single out tokens with a large covariance between advantage and log-prob (the
tokens that drive entropy collapse) and treat them differently: Clip-Cov drops
their gradient, KL-Cov adds a |log-ratio| penalty. The covariance is computed over
the tokens of the local micro-batch, as in verl.
"""

from __future__ import annotations

import torch

from verl_megatron.algos.policy_losses import (
    LossCall,
    LossResult,
    _metrics,
    policy_loss,
)
from verl_megatron.utils.torch_functional import masked_mean

__all__ = ["compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov"]


@policy_loss("clip_cov")
def compute_policy_loss_clip_cov(c: LossCall) -> LossResult:
    """PPO clip loss with the gradient of a few high-covariance tokens removed.

    cov_t = (A_t - mean A) * (log_prob_t - mean log_prob) over unmasked tokens.
    Candidates: unmasked tokens not already clipped by PPO with
    clip_cov_lb < cov_t < clip_cov_ub (config.policy_loss, defaults 1.0 / 5.0);
    max(1, int(clip_cov_ratio * #tokens)) of them (default ratio 2e-4), drawn at
    random (torch's global RNG) when there are more, get a loss of 0.
    pg_clipfrac is the fraction of tokens so dropped.
    """
    c.check("clip_cov")
    clip_cov_ratio = float(c.loss_setting("clip_cov_ratio", 0.0002))
    clip_cov_lb = float(c.loss_setting("clip_cov_lb", 1.0))
    clip_cov_ub = float(c.loss_setting("clip_cov_ub", 5.0))
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov: policy_loss.clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    low, high = c.clip_ratios()

    log_ratio = c.log_prob - c.old_log_prob
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, c.response_mask)
    unclipped = -c.advantages * ratio
    clipped = -c.advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = c.response_mask.bool()

    with torch.no_grad():
        lp = c.log_prob.detach()
        cov = (c.advantages - masked_mean(c.advantages, c.response_mask)) * (
            lp - masked_mean(lp, c.response_mask)
        )
        candidates = valid & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        candidate_idx = torch.nonzero(candidates)
        clip_num = max(int(clip_cov_ratio * c.response_mask.sum().item()), 1)
        if len(candidate_idx) > clip_num:
            perm = torch.randperm(len(candidate_idx), device=candidate_idx.device)
            candidate_idx = candidate_idx[perm[:clip_num]]
        keep = torch.ones_like(c.advantages)
        keep[candidate_idx[:, 0], candidate_idx[:, 1]] = 0

    pg_clipfrac = masked_mean((keep == 0).to(c.log_prob.dtype), c.response_mask)
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = c.aggregate(pg_losses)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl)


@policy_loss("kl_cov")
def compute_policy_loss_kl_cov(c: LossCall) -> LossResult:
    """Unclipped PG loss -A * r, plus ppo_kl_coef * |log r| on the top-covariance tokens.

    The max(1, int(#tokens * kl_cov_ratio)) unmasked tokens with the largest
    cov_t = (A_t - mean A) * (log_prob_t - mean log_prob) get the penalty
    (config.policy_loss.kl_cov_ratio, default 2e-4; ppo_kl_coef, default 1.0).
    The metric actor/ppo_kl is the masked mean of |log r| here, as in verl.
    """
    c.check("kl_cov")
    kl_cov_ratio = float(c.loss_setting("kl_cov_ratio", 0.0002))
    ppo_kl_coef = float(c.loss_setting("ppo_kl_coef", 1.0))
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov: policy_loss.kl_cov_ratio must be > 0, got {kl_cov_ratio}")

    log_ratio = c.log_prob - c.old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    pg_losses = -c.advantages * ratio
    penalised = torch.zeros_like(c.response_mask, dtype=torch.bool)

    with torch.no_grad():
        flat_valid = torch.nonzero(c.response_mask.reshape(-1).bool(), as_tuple=True)[0]
        if flat_valid.numel() > 0:
            adv = c.advantages.detach().reshape(-1)[flat_valid]
            lp = c.log_prob.detach().reshape(-1)[flat_valid]
            cov = (adv - adv.mean()) * (lp - lp.mean())
            k = max(1, int(flat_valid.numel() * kl_cov_ratio))
            top = flat_valid[torch.topk(cov, k, largest=True).indices]
            penalised.view(-1)[top] = True

    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * abs_kl, pg_losses)
    pg_loss = c.aggregate(pg_losses)
    return pg_loss, _metrics(ppo_kl=masked_mean(abs_kl, c.response_mask))
