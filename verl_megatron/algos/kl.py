"""KL estimators between the policy and the reference, KL controllers, KL-in-reward.

Estimators follow J. Schulman, "Approximating KL divergence" (2020): with
d = logprob - ref_logprob on tokens sampled from the policy, k1 = d is unbiased,
k2 = d^2 / 2 is low-variance and biased, k3 = exp(-d) + d - 1 is unbiased and
low-variance. Only k2's gradient is the gradient of the true KL in expectation;
a trailing "+" keeps the estimator's value but takes k2's gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_megatron.utils.torch_functional import masked_mean

__all__ = [
    "KL_PENALTY_NAMES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty_to_rewards",
    "compute_rewards",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
]

KL_PENALTY_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# exp(20) ~ 5e8 is already far beyond a meaningful log-ratio; the clamp keeps exp finite.
_K3_MAX_LOG_RATIO = 20.0
# k3 per token is clipped to [-10, 10] so a single wild token cannot dominate the penalty.
_K3_MAX_VALUE = 10.0


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] for a name without the trailing "+" (see kl_penalty)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, -_K3_MAX_LOG_RATIO, _K3_MAX_LOG_RATIO)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -_K3_MAX_VALUE, _K3_MAX_VALUE)
    if kl_penalty == "full":
        raise NotImplementedError(
            "kl_penalty='full' needs the full-vocabulary distributions of both models; "
            "kl_penalty only receives the log-probs of the sampled tokens. Use k1/k2/k3 (optionally with '+')."
        )
    raise NotImplementedError(f"kl_penalty {kl_penalty!r} is not supported; use one of {KL_PENALTY_NAMES}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference log-probs [B, T] -> [B, T].

    Names: kl/k1 (d), abs (|d|), mse/k2 (d^2 / 2), low_var_kl/k3 (clamped
    exp(-d) + d - 1, d clamped to [-20, 20], result to [-10, 10]), with
    d = logprob - ref_logprob. "<name>+" (e.g. "k3+") returns the value of <name>
    with the gradient of k2 (straight-through); "k2+"/"mse+" are plain k2.
    "full" and unknown names raise NotImplementedError.
    """
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"kl_penalty: logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ in shape"
        )
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    value = kl_penalty_forward(logprob, ref_logprob, base)
    if base == kl_penalty or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593).

    value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Constant coefficient: nothing to update."""


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Controller from a config with verl's `algorithm.kl_ctrl` fields: type ("fixed" or
    "adaptive"), kl_coef, and for adaptive target_kl and horizon."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon
        )
    raise NotImplementedError(f"kl_ctrl.type {kl_ctrl.type!r} is not supported; use 'fixed' or 'adaptive'")


def compute_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_ratio: float,
) -> torch.Tensor:
    """token_level_scores - kl_ratio * (old_log_prob - ref_log_prob), all [B, T]."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward (verl's `apply_kl_penalty` on tensors): rewards = scores - beta * kl.

    kl = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask, all
    [B, T]; beta = kl_ctrl.value before the update. current_kl = batch mean of the
    per-sequence masked mean of kl; the controller is then updated with
    (current_kl, n_steps=B). Returns (token_level_rewards [B, T], metrics) with
    metrics "actor/reward_kl_penalty" (current_kl) and "actor/reward_kl_penalty_coeff" (beta).
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, response_mask, axis=-1).mean().item())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {
        "actor/reward_kl_penalty": current_kl,
        "actor/reward_kl_penalty_coeff": float(beta),
    }
