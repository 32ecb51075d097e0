"""More advantage estimators under verl 0.9's names: vectorized GRPO/RLOO, GDPO and the
optimal token baselines (OTB). Same contract as `advantages`: [B, T] in,
(advantages, returns) [B, T] out, group statistics per distinct `index` value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_megatron.algos.advantages import (
    AdvantageEstimator,
    _config_get,
    _group_ids,
    _grpo,
    _leave_one_out,
    _outcome,
    _spread,
    compute_grpo_outcome_advantage,
    register_adv_est,
)
from verl_megatron.errors import VerlCompatError
from verl_megatron.utils.torch_functional import masked_whiten

__all__ = [
    "compute_gdpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_rloo_vectorized_outcome_advantage",
]


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO computed with float32 group sums (verl's `grpo_vectorized`); same numbers as grpo."""
    scores, gid = _outcome(
        "compute_grpo_vectorized_outcome_advantage", token_level_rewards, response_mask, index
    )
    advantage = _grpo(scores.float(), gid, epsilon, norm_adv_by_std_in_grpo)
    return _spread(advantage.to(token_level_rewards.dtype), response_mask)


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO, (n s_i - sum_g) / (n - 1); unlike `rloo`, a singleton group gets 0 (as verl's)."""
    scores, gid = _outcome(
        "compute_rloo_vectorized_outcome_advantage", token_level_rewards, response_mask, index
    )
    count, loo = _leave_one_out(scores, gid)
    return _spread(loo * (count > 1).to(scores.dtype), response_mask)


def _gdpo_components(config: Any, non_tensor_batch: Any, batch: Any, response_mask: torch.Tensor) -> list:
    """One [B, T] reward tensor per `config.gdpo_reward_keys` entry, the value at each
    response's last valid token (found from batch's prompts and attention_mask)."""
    keys = _config_get(config, "gdpo_reward_keys", None)
    if not keys:
        raise VerlCompatError(
            "GDPO needs algorithm.gdpo_reward_keys: the reward component keys compute_score returns "
            "(e.g. ['format_reward', 'accuracy_reward'])"
        )
    prompt_len = batch["prompts"].size(1)
    last = (batch["attention_mask"][:, prompt_len:].sum(dim=1) - 1).to(response_mask.device)
    rows = torch.arange(response_mask.shape[0], device=response_mask.device)
    components = []
    for key in keys:
        if key not in non_tensor_batch:
            raise VerlCompatError(
                f"GDPO reward key {key!r} is not in non_tensor_batch (has {sorted(non_tensor_batch)}); "
                "compute_score must return a dict with it"
            )
        values = torch.tensor(
            np.asarray(non_tensor_batch[key], dtype=np.float32), device=response_mask.device
        )
        scores = torch.zeros_like(response_mask, dtype=torch.float32)
        scores[rows, last] = values
        components.append(scores)
    return components


@register_adv_est(AdvantageEstimator.GDPO)
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv:2601.05242): GRPO-normalise each reward component within its group,
    sum them with `config.gdpo_reward_weights` (default 1 each), then whiten over the
    batch's unmasked tokens. Without config, non_tensor_batch and batch the single
    component is `token_level_rewards`."""
    if config is not None and non_tensor_batch is not None and batch is not None:
        components = _gdpo_components(config, non_tensor_batch, batch, response_mask)
        weights = _config_get(config, "gdpo_reward_weights", None)
    else:
        components, weights = [token_level_rewards], None
    if weights is None:
        weights = [1.0] * len(components)
    if len(weights) != len(components):
        raise VerlCompatError(
            f"GDPO: {len(weights)} gdpo_reward_weights for {len(components)} gdpo_reward_keys"
        )
    total = torch.zeros_like(response_mask, dtype=torch.float32)
    for weight, component in zip(weights, components):
        normalised, _ = compute_grpo_outcome_advantage(
            component, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config
        )
        total = total + float(weight) * normalised
    mask = response_mask.to(total.dtype)
    advantages = masked_whiten(total, mask) * mask
    return advantages, advantages


def _otb_inputs(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-to-go G_t and the cumulative path-variance proxy W_t = sum_{j<=t} w_j with
    w_j = (1 - 2 pi_j + sum_v pi_v^2) * rho_j^2 (rho = rollout IS weight, 1 without)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights**2
    return returns, (w * mask).cumsum(dim=-1)


def _zero_tail(baselines: torch.Tensor, row_ids: list[int], lengths: torch.Tensor) -> None:
    """Baseline 0 past the second-longest length on the single longest row of a group: no
    other sample of the group covers those steps."""
    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    holders = (lengths == longest).nonzero(as_tuple=True)[0]
    if holders.numel() == 1 and longest > second:
        baselines[row_ids[int(holders[0])], second:] = 0.0


def _groups(index: Any, keep: torch.Tensor) -> dict[int, list[int]]:
    gid = _group_ids(index, keep.shape[0], "optimal token baseline").tolist()
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(gid):
        if bool(keep[row]):
            groups.setdefault(group, []).append(row)
    return groups


def _group_baselines(
    g: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor | None,
    groups: dict[int, list[int]],
    lengths: torch.Tensor,
    handle_zero_tail: bool,
    epsilon: float,
) -> torch.Tensor:
    """Per group of >= 2 rows and step t: B_t = sum_i g w m / (sum_i w m + epsilon) ([B, T], m None:
    no mask); singleton groups 0. `lengths` [B] are the rows' step counts (for the zero tail)."""
    baselines = torch.zeros_like(g)
    for rows in groups.values():
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows, device=g.device)
        gw, ww = g[idx] * w[idx], w[idx]
        if m is not None:
            gw, ww = gw * m[idx], ww * m[idx]
        baselines[idx] = gw.sum(dim=0) / (ww.sum(dim=0) + epsilon)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[idx])
    return baselines


def _otb_by_position(
    returns: torch.Tensor,
    w_cum: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    zero_tail: bool,
    eps: float,
) -> torch.Tensor:
    mask = response_mask.to(returns.dtype)
    groups = _groups(index, torch.ones(mask.shape[0], dtype=torch.bool))
    baselines = _group_baselines(returns, w_cum, mask, groups, mask.sum(dim=-1), zero_tail, eps)
    return (returns - baselines) * mask


def _otb_by_rank(
    returns: torch.Tensor,
    w_cum: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    zero_tail: bool,
    eps: float,
) -> torch.Tensor:
    """Each row's unmasked steps packed to the left, baselines over the packed steps, unpacked."""
    keep = response_mask.bool()
    lengths = keep.sum(dim=-1)
    width = int(lengths.max()) if lengths.numel() else 0
    packed_w = w_cum.new_zeros((keep.shape[0], width))
    packed_g = torch.zeros_like(packed_w)
    for row in range(keep.shape[0]):
        n = int(lengths[row])
        packed_w[row, :n] = w_cum[row, keep[row]]
        packed_g[row, :n] = returns[row, keep[row]]
    groups = _groups(index, lengths > 0)
    packed_adv = packed_g - _group_baselines(packed_g, packed_w, None, groups, lengths, zero_tail, eps)
    advantages = torch.zeros_like(returns)
    for row in range(keep.shape[0]):
        n = int(lengths[row])
        if n:
            advantages[row, keep[row]] = packed_adv[row, :n]
    return advantages * response_mask.to(advantages.dtype)


def _otb_estimator(name: AdvantageEstimator, aligned_by_rank: bool, fn_name: str, doc: str) -> Any:
    """Register an OTB estimator under `name` with verl's signature; a group's steps align by
    absolute position or by rank among each row's unmasked tokens."""

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: np.ndarray,
        old_log_probs: torch.Tensor,
        sum_pi_squared: torch.Tensor,
        rollout_is_weights: torch.Tensor | None = None,
        handle_zero_tail: bool = True,
        epsilon: float = 1e-8,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        returns, w_cum = _otb_inputs(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        otb = _otb_by_rank if aligned_by_rank else _otb_by_position
        return otb(returns, w_cum, response_mask, index, handle_zero_tail, epsilon), returns

    estimator.__name__ = estimator.__qualname__ = fn_name
    estimator.__doc__ = doc
    return register_adv_est(name)(torch.no_grad()(estimator))


compute_optimal_token_baseline_advantage = _otb_estimator(
    AdvantageEstimator.OPTIMAL_TOKEN_BASELINE,
    False,
    "compute_optimal_token_baseline_advantage",
    """Optimal token baseline: per group and position t, B_t = sum_i G_t W_t / (sum_i W_t + eps)
    over the group's rows (masked), A = (G - B) * mask; returns = reward-to-go G.

    `sum_pi_squared` [B, T] is sum_v pi_v^2 of the old policy at each position. Singleton
    groups have baseline 0. Positions are aligned by absolute index t.""",
)

compute_multi_turn_optimal_token_baseline_advantage = _otb_estimator(
    AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE,
    True,
    "compute_multi_turn_optimal_token_baseline_advantage",
    """OTB for multi-turn (tool-integrated) responses: like `optimal_token_baseline`, but
    steps are aligned by their rank among each row's unmasked tokens (observation spans
    removed), so the k-th generated token of every sample shares a baseline.""",
)
