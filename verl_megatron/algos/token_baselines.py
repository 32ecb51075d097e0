"""Optimal token baselines (OTB) under verl 0.9's names: per group and step, a baseline
weighted by the cumulative path-variance proxy. Same contract as `advantages`: [B, T] in,
(advantages, returns) [B, T] out, groups per distinct `index` value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_megatron.algos.advantages import AdvantageEstimator, _group_ids, register_adv_est

__all__ = [
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
]


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


@dataclass(frozen=True)
class _OtbCall:
    """One OTB call: reward-to-go G and cumulative W [B, T] (`_otb_inputs`), the mask, groups."""

    returns: torch.Tensor
    w_cum: torch.Tensor
    response_mask: torch.Tensor
    index: Any
    handle_zero_tail: bool
    epsilon: float


def _otb_by_position(c: _OtbCall) -> torch.Tensor:
    mask = c.response_mask.to(c.returns.dtype)
    groups = _groups(c.index, torch.ones(mask.shape[0], dtype=torch.bool))
    lengths = mask.sum(dim=-1)
    baselines = _group_baselines(c.returns, c.w_cum, mask, groups, lengths, c.handle_zero_tail, c.epsilon)
    return (c.returns - baselines) * mask


def _otb_by_rank(c: _OtbCall) -> torch.Tensor:
    """Each row's unmasked steps packed to the left, baselines over the packed steps, unpacked."""
    keep = c.response_mask.bool()
    lengths = keep.sum(dim=-1)
    width = int(lengths.max()) if lengths.numel() else 0
    packed_w = c.w_cum.new_zeros((keep.shape[0], width))
    packed_g = torch.zeros_like(packed_w)
    for row in range(keep.shape[0]):
        n = int(lengths[row])
        packed_w[row, :n] = c.w_cum[row, keep[row]]
        packed_g[row, :n] = c.returns[row, keep[row]]
    groups = _groups(c.index, lengths > 0)
    baselines = _group_baselines(packed_g, packed_w, None, groups, lengths, c.handle_zero_tail, c.epsilon)
    packed_adv = packed_g - baselines
    advantages = torch.zeros_like(c.returns)
    for row in range(keep.shape[0]):
        n = int(lengths[row])
        if n:
            advantages[row, keep[row]] = packed_adv[row, :n]
    return advantages * c.response_mask.to(advantages.dtype)


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
        call = _OtbCall(returns, w_cum, response_mask, index, handle_zero_tail, epsilon)
        return otb(call), returns

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
