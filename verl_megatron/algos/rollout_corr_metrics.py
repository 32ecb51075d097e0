"""Diagnostics of rollout correction (see `rollout_corr_helper`), verl 0.9's metric names.

Metric keys carry no prefix here; `rollout_corr_helper` adds ``rollout_corr/``.
"""

from __future__ import annotations

import torch

from verl_megatron.utils.torch_functional import masked_mean, masked_sum

__all__ = ["SAFETY_BOUND", "compute_is_metrics", "compute_offpolicy_metrics", "compute_rs_metrics"]

# exp(+-20) (~5e8 / 2e-9) bounds every exponentiated log-ratio: far past any useful
# weight, and finite in every float type.
SAFETY_BOUND = 20.0


def _require_tokens(response_mask: torch.Tensor) -> None:
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")


def _masked_max(values: torch.Tensor, keep: torch.Tensor) -> float:
    return values.masked_fill(~keep, float("-inf")).max().item()


def _masked_min(values: torch.Tensor, keep: torch.Tensor) -> float:
    return values.masked_fill(~keep, float("inf")).min().item()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """Masked std of values clamped to [low, high] (0 for fewer than two tokens)."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - mean.square()
    return torch.sqrt(torch.clamp(var, min=0.0)).item()


def _seq_summary(prefix: str, seq: torch.Tensor, ideal: float) -> dict[str, float]:
    return {
        f"{prefix}_seq_mean": seq.mean().item(),
        f"{prefix}_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
        f"{prefix}_seq_max": seq.max().item(),
        f"{prefix}_seq_min": seq.min().item(),
        f"{prefix}_seq_max_deviation": (seq - ideal).abs().max().item(),
    }


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """Statistics of one rejection criterion ``rollout_rs_<option>_*``: mean, max/min,
    fraction above/below the thresholds, clamped std and per-sequence summaries.
    `rs_statistic` is per token [B, T] (a sequence statistic broadcast over its row)."""
    _require_tokens(response_mask)
    p = f"rollout_rs_{option_name}"
    keep = response_mask.bool()
    seq = (
        per_sequence_values
        if per_sequence_values is not None
        else masked_mean(rs_statistic, response_mask, -1)
    )
    seq = seq.squeeze(-1) if seq.dim() > 1 else seq
    seq = seq[seq_valid_mask]
    per_seq = level == "sequence" and seq.numel() > 0
    lower = rollout_rs_threshold_lower if apply_lower_threshold else 0.0
    m = {f"{p}_mean": masked_mean(rs_statistic, response_mask).item()}
    if per_seq:
        m[f"{p}_max"], m[f"{p}_min"] = seq.max().item(), seq.min().item()
        high_frac = (seq > rollout_rs_threshold).float().mean().item()
        low_frac = (seq < lower).float().mean().item() if apply_lower_threshold else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _masked_max(rs_statistic, keep), _masked_min(rs_statistic, keep)
        high_frac = masked_mean((rs_statistic > rollout_rs_threshold).float(), response_mask).item()
        below = masked_mean((rs_statistic < lower).float(), response_mask).item()
        low_frac = below if apply_lower_threshold else 0.0
    m[f"{p}_fraction_high"], m[f"{p}_fraction_low"] = high_frac, low_frac
    m[f"{p}_std"] = _clamped_std(rs_statistic, response_mask, lower, rollout_rs_threshold)
    if seq.numel() == 0:
        names = ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high")
        m.update({f"{p}_{name}": 0.0 for name in (*names, "seq_fraction_low")})
        return m
    m.update(_seq_summary(p, seq, 0.0))
    m[f"{p}_seq_fraction_high"] = (seq > rollout_rs_threshold).float().mean().item()
    if apply_lower_threshold:
        m[f"{p}_seq_fraction_low"] = (seq < lower).float().mean().item()
    return m


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> dict[str, float]:
    """Statistics of IS weights ``rollout_is_*``: mean/max/min, fractions of raw weights
    beyond the thresholds (lower default 1 / upper), std and effective sample size of
    the applied weights, and per-sequence summaries."""
    _require_tokens(response_mask)
    upper = rollout_is_threshold
    lower = 1.0 / upper if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    keep = response_mask.bool()
    m: dict[str, float] = {}
    if rollout_is == "sequence":
        # log space: a product of token ratios overflows long before its log does
        log_up = torch.log(torch.tensor(upper, device=log_ratio_for_metrics.device))
        log_low = torch.log(torch.tensor(lower, device=log_ratio_for_metrics.device))
        m["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        m["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_up).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_low).float().mean().item()
    else:
        m["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw_rollout_is_weights > upper).float(), response_mask
        ).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw_rollout_is_weights < lower).float(), response_mask
        ).item()
        m["rollout_is_max"] = _masked_max(rollout_is_weights, keep)
        m["rollout_is_min"] = _masked_min(rollout_is_weights, keep)
    m["rollout_is_std"] = _clamped_std(rollout_is_weights, response_mask, 0.0, upper)
    clamped = rollout_is_weights.clamp(min=0.0, max=upper)
    normalised = clamped / (masked_mean(clamped, response_mask) + 1e-8)
    second_moment = masked_mean(normalised.square(), response_mask).item()
    # Every weight zeroed (IcePop rejected all): no effective sample. verl 0.9.1 raises
    # ZeroDivisionError here, so no caller can depend on its number: 0 is kept, with no option.
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0
    if rollout_is_weights.dim() > 1:
        m.update(_seq_summary("rollout_is", masked_mean(rollout_is_weights, response_mask, -1), 1.0))
        # raw means: a mean of weights truncated at the threshold can never exceed it
        raw_seq = masked_mean(raw_rollout_is_weights, response_mask, -1)
        m["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean().item()
        m["rollout_is_seq_fraction_low"] = (raw_seq < lower).float().mean().item()
    return m


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the training policy (old_log_prob) is from the rollout policy, [B, T] inputs:
    training_ppl / training_log_ppl (batch means of per-sequence values) and, with rollout
    log-probs, kl (E[log pi_rollout - log pi_train]), k3_kl, rollout_ppl, rollout_log_ppl,
    log_ppl_diff (+abs/max/min), ppl_ratio, chi2_token (E[rho^2] - 1), chi2_seq."""
    if not response_mask.any():
        raise AssertionError("Expected at least one valid token in response_mask")
    train_mean = masked_mean(old_log_prob, response_mask, -1)
    m = {
        "training_ppl": torch.exp(-train_mean).mean().item(),
        "training_log_ppl": (-train_mean).mean().item(),
    }
    if rollout_log_prob is None:
        return m
    log_ratio = old_log_prob - rollout_log_prob
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    rollout_mean = masked_mean(rollout_log_prob, response_mask, -1)
    m["rollout_ppl"] = torch.exp(-rollout_mean).mean().item()
    m["rollout_log_ppl"] = (-rollout_mean).mean().item()
    diff = rollout_mean - train_mean
    m["log_ppl_diff"] = diff.mean().item()
    m["log_ppl_abs_diff"] = diff.abs().mean().item()
    m["log_ppl_diff_max"] = diff.max().item()
    m["log_ppl_diff_min"] = diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    m["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    seq_log = torch.clamp(masked_sum(log_ratio, response_mask, -1), -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * seq_log).mean() - 1.0).item()
    return m
