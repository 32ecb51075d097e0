"""Advantage estimators, dispatched by name (verl's `algorithm.adv_estimator`).

Each estimator takes [B, T] `token_level_rewards` and `response_mask` (plus what it
needs: values, group `index` of length B, reward baselines, config) and returns
(advantages, returns), both [B, T]; advantages are zero at masked positions (GAE:
only with `zero_masked=True`, verl leaves whitened values there). Outcome estimators
use the per-sequence score s_i = sum_t token_level_rewards[i, t]. Group statistics
are per distinct value of `index` (verl's `uid`); a singleton group has baseline 0
(and std 1), so nothing divides by zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from verl_megatron.algos.policy_losses import core_registry
from verl_megatron.errors import VerlCompatError
from verl_megatron.utils.torch_functional import masked_whiten

# The public names are listed once, in core_algos (verl's import path).


class AdvantageEstimator(str, Enum):
    """Names of the built-in estimators (a typo fails at enum lookup, not mid-run)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _name(name_or_enum: str | AdvantageEstimator) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: str | AdvantageEstimator) -> Callable[[Callable], Callable]:
    """Decorator registering an estimator; registering another function under a taken name raises."""

    def decorator(fn: Callable) -> Callable:
        name = _name(name_or_enum)
        registry = core_registry("ADV_ESTIMATOR_REGISTRY", ADV_ESTIMATOR_REGISTRY)
        if registry.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered as {registry[name]}")
        registry[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(
    name_or_enum: str | AdvantageEstimator,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator registered under a name; ValueError listing the known names otherwise."""
    name = _name(name_or_enum)
    registry = core_registry("ADV_ESTIMATOR_REGISTRY", ADV_ESTIMATOR_REGISTRY)
    if name not in registry:
        # verl's wording starts the message; code and tests match on it.
        raise ValueError(f"Unknown advantage estimator simply: {name}; registered: {sorted(registry)}")
    return registry[name]


def _config_get(config: Any, name: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def _group_ids(index: Sequence[Any] | np.ndarray | torch.Tensor, batch_size: int, where: str) -> torch.Tensor:
    """Map each row's group key to 0..G-1 (first-seen order): [B] long."""
    keys = index.tolist() if isinstance(index, (np.ndarray, torch.Tensor)) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"{where}: index has {len(keys)} entries, expected one per row ({batch_size})")
    ids: dict[Any, int] = {}
    return torch.tensor([ids.setdefault(key, len(ids)) for key in keys], dtype=torch.long)


def _group_sum(values: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per-group sum of [B] values, gathered back to [B]."""
    num_groups = int(gid.max()) + 1 if gid.numel() else 0
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, gid.to(values.device), values)[gid.to(values.device)]


def _group_stats(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, unbiased std) of each row's group, [B] each; singleton: mean 0, std 1."""
    count = _group_sum(torch.ones_like(scores), gid)
    mean = _group_sum(scores, gid) / count
    var = _group_sum((scores - mean) ** 2, gid) / (count - 1).clamp(min=1)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    return count, mean, std


def _check_rewards(where: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> None:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"{where}: token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be the same [B, T] shape"
        )


def _outcome(
    where: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B] (float) and group ids [B] for the outcome estimators."""
    _check_rewards(where, token_level_rewards, response_mask)
    scores = token_level_rewards.detach().sum(dim=-1)
    return scores, _group_ids(index, scores.shape[0], where)


def _grpo(scores: torch.Tensor, gid: torch.Tensor, epsilon: float, normalise: bool) -> torch.Tensor:
    """GRPO's per-sequence advantage [B]: s_i - mean_g, divided by (std_g + epsilon) when normalising."""
    _, mean, std = _group_stats(scores, gid)
    advantage = scores - mean
    return advantage / (std + epsilon) if normalise else advantage


def _leave_one_out(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group size, s_i minus the mean of the other scores of its group), [B] each."""
    count = _group_sum(torch.ones_like(scores), gid)
    return count, (count * scores - _group_sum(scores, gid)) / (count - 1).clamp(min=1)


def _spread(per_seq: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = per_seq.unsqueeze(-1) * response_mask.to(per_seq.dtype)
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    zero_masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) over the response; masked positions are skipped, not terminal.

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, where
    "t+1" is the next unmasked position. returns = A + V (before whitening); the
    advantages are then whitened over all unmasked tokens of the batch. At masked
    positions they keep verl 0.9.1's whitened leftovers (the carried advantage, shifted
    and scaled) unless `zero_masked` (the project's trainer passes it), which makes them
    0 like every other estimator's, so sums and dumps over the whole tensor are clean.
    """
    _check_rewards("compute_gae_advantage_return", token_level_rewards, response_mask)
    if values.shape != response_mask.shape:
        raise ValueError(
            f"compute_gae_advantage_return: values {tuple(values.shape)} is not [B, T] like the mask"
        )
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    reversed_adv = []
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # A masked position carries the running value and advantage through unchanged.
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask)
    return (advantages * mask if zero_masked else advantages), returns


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (s_i - mean_g) / (std_g + epsilon), std unbiased; without std if
    `norm_adv_by_std_in_grpo` is False (Dr.GRPO). Broadcast over unmasked tokens."""
    scores, gid = _outcome("compute_grpo_outcome_advantage", token_level_rewards, response_mask, index)
    return _spread(_grpo(scores, gid, epsilon, norm_adv_by_std_in_grpo), response_mask)


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (arXiv:2503.19595): only the best response of a group gets r_max - r_second,
    divided by (std_g + epsilon) when normalising. `config.norm_adv_by_std_in_grpo`, when
    present, overrides the argument (as verl reads it from config). Groups need >= 2 rows.
    """
    scores, gid = _outcome("compute_grpo_passk_outcome_advantage", token_level_rewards, response_mask, index)
    normalise = bool(_config_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo))
    advantage = torch.zeros_like(scores)
    for group in range(int(gid.max()) + 1 if gid.numel() else 0):
        rows = torch.nonzero(gid == group, as_tuple=True)[0].to(scores.device)
        if rows.numel() < 2:
            raise ValueError(
                f"compute_grpo_passk_outcome_advantage: pass@k needs >= 2 samples per group, "
                f"group of row {int(rows[0])} has {rows.numel()}"
            )
        group_scores = scores[rows]
        top, top_idx = torch.topk(group_scores, 2)
        gap = top[0] - top[1]
        if normalise:
            gap = gap / (group_scores.std() + epsilon)
        advantage[rows[top_idx[0]]] = gap
    return _spread(advantage, response_mask)


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): s_i minus the mean of the OTHER scores of its group,
    i.e. (n s_i - sum_g) / (n - 1); a singleton keeps its score (baseline 0)."""
    scores, gid = _outcome("compute_rloo_outcome_advantage", token_level_rewards, response_mask, index)
    count, loo = _leave_one_out(scores, gid)
    return _spread(torch.where(count > 1, loo, scores), response_mask)


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): baseline = length-weighted group mean sum(l s) / sum(l),
    l = unmasked tokens per row; singleton (or zero-length) groups use baseline 0."""
    scores, gid = _outcome("compute_opo_outcome_advantage", token_level_rewards, response_mask, index)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    count = _group_sum(torch.ones_like(scores), gid)
    total_len = _group_sum(lengths, gid)
    baseline = _group_sum(lengths * scores, gid) / total_len.clamp(min=1)
    baseline = torch.where((count > 1) & (total_len > 0), baseline, torch.zeros_like(baseline))
    return _spread(scores - baseline, response_mask)


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: alpha * (s_i - mean_g) / f_norm with alpha = B / max(1, #rows with s != 0).

    As in verl, alpha is always recomputed that way (the argument only keeps verl's
    signature); the baseline of a singleton group is 0.
    """
    scores, gid = _outcome("compute_gpg_outcome_advantage", token_level_rewards, response_mask, index)
    batch_alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    _, mean, _ = _group_stats(scores, gid)
    return _spread(batch_alpha * (scores - mean) / f_norm, response_mask)


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv:2501.03262): s_i - mean_g on every unmasked token,
    then whitened over all unmasked tokens of the batch."""
    scores, gid = _outcome("compute_reinforce_plus_plus_baseline", token_level_rewards, response_mask, index)
    _, mean, _ = _group_stats(scores, gid)
    mask = response_mask.to(scores.dtype)
    advantages = (scores - mean).unsqueeze(-1) * mask
    advantages = masked_whiten(advantages, mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): discounted return-to-go with `config.gamma`,
    whitened over the batch's unmasked tokens.

    The discount runs over unmasked tokens only: a masked span inside a response (a
    tool observation of a multi-turn episode) is skipped, carrying the running return
    through unchanged, so earlier turns get credit for a later reward. Returns are 0
    on masked tokens. E.g. rewards [0, 0, 0, 0, 2], mask [1, 1, 0, 0, 1], gamma 0.5
    give returns [0.5, 1, 0, 0, 2].
    """
    _check_rewards("compute_reinforce_plus_plus_outcome_advantage", token_level_rewards, response_mask)
    gamma = _config_get(config, "gamma", None)
    if gamma is None:
        raise VerlCompatError(
            "compute_reinforce_plus_plus_outcome_advantage: needs config.gamma (algorithm config)"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        candidate = token_level_rewards[:, t] + gamma * running
        returns[:, t] = candidate * mask[:, t]
        running = candidate * mask[:, t] + running * (1 - mask[:, t])
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): returns = masked reward-to-go; advantages = returns -
    reward_baselines [B] (the greedy response's reward) on unmasked tokens."""
    _check_rewards("compute_remax_outcome_advantage", token_level_rewards, response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"compute_remax_outcome_advantage: reward_baselines has shape {tuple(reward_baselines.shape)}, "
            f"expected [B] = {tuple(token_level_rewards.shape[:1])}"
        )
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1).to(returns.dtype) * mask
    return advantages, returns


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
