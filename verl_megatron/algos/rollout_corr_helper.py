"""Rollout correction (verl 0.9's ``rollout_corr_helper``): the rollout engine's policy
(e.g. bf16 vLLM, or an older checkpoint) is not exactly the policy being trained.

With log_ratio = log pi_train - log pi_rollout per token [B, T]:
- importance-sampling (IS) weights correct the gradient's expectation, per token or per
  sequence (the product of a row's token ratios), truncated at an upper bound (TIS) or
  zeroed outside [lower, upper] (IcePop, threshold "lower_upper");
- rejection sampling (RS) drops tokens or whole sequences whose divergence estimate is
  too large (a hard trust region) by zeroing them in the response mask;
- diagnostics (KL, perplexities, chi^2) go to ``rollout_corr/*`` metrics.
`apply_bypass_mode` trains on the rollout log-probs directly (no old-log-prob pass).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, open_dict

from verl_megatron.algos.rollout_corr_metrics import (
    SAFETY_BOUND,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rs_metrics,
)
from verl_megatron.utils.torch_functional import masked_mean, masked_sum

# The config check reads this module's levels and threshold parsers: the protocol (tensordict,
# torch._dynamo) loads where a batch is built, not whenever a config is validated.
if TYPE_CHECKING:
    from verl_megatron.protocol import DataProto

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "apply_bypass_mode",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
    "rollout_is_weights",
]

TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}
SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = (
    TOKEN_LEVEL_ROLLOUT_RS_OPTIONS
    | {f"seq_{how}_{k}" for how in ("sum", "mean") for k in ("k1", "k2", "k3")}
    | {"seq_max_k2", "seq_max_k3"}
)
IS_LEVELS = ("token", "sequence")


def _cfg(config: Any, name: str, default: Any) -> Any:
    """`config[name]` for a mapping or DictConfig, `config.name` for a dataclass."""
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


def _positive(value: float, what: str) -> float:
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}.")
    return value


def parse_rollout_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """(upper, lower) from a number (TIS: lower None) or a "lower_upper" string (IcePop)."""
    if isinstance(spec, bool):  # bool is an int: True would silently mean 1.0
        raise TypeError(
            f"rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean ({spec})."
        )
    if not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}.")
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string.")
        try:
            if "_" in text:
                low_text, up_text = text.split("_", 1)
                lower, upper = float(low_text), float(up_text)
            else:
                upper = float(text)
        except ValueError as exc:
            raise ValueError(f"Invalid rollout_is_threshold '{spec}'.") from exc
    else:
        upper = float(spec)
    _positive(upper, "rollout_is_threshold upper bound")
    if lower is not None:
        _positive(lower, "rollout_is_threshold lower bound")
        if lower > upper:
            raise ValueError(f"rollout_is_threshold lower bound must be <= upper bound, got '{spec}'.")
    return upper, lower


def _number(text: str, option: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"Invalid numeric threshold '{spec}' for option '{option}'.") from None


def _parse_one_rs(option: str, spec: str) -> dict[str, float | None]:
    """k1 options: ratio bounds "lower_upper" (lower defaults to 1/upper); others: one upper."""
    lower: float | None = None
    if option.endswith("k1"):
        low_text, up_text = spec.split("_", 1) if "_" in spec else (None, spec)
        upper = _number(up_text, option, spec)
        if low_text is not None:
            lower = _number(low_text, option, spec)
        elif upper > 0:
            lower = 1.0 / upper
    elif "_" in spec:
        raise ValueError(
            f"rollout_rs_threshold for option '{option}' must be a single upper bound, got '{spec}'."
        )
    else:
        upper = _number(spec, option, spec)
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"Thresholds for option '{option}' must be positive, got {spec}.")
    if lower is not None and lower > upper:
        raise ValueError(f"Thresholds for option '{option}' must be lower <= upper, got {spec}.")
    return {"lower": lower, "upper": upper}


def parse_rollout_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, dict]:
    """Per-option thresholds from one shared value or one comma-separated value per option."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(
            "rollout_rs_threshold must be a string or numeric value specifying per-option thresholds."
        )
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold has {len(parts)} values for {len(options)} rollout_rs options; "
            "give one shared value or one per option."
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    return {option: _parse_one_rs(option, part) for option, part in zip(options, parts)}


def _rs_options(rollout_rs: Any) -> list[str]:
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    options = list(dict.fromkeys(opt.strip() for opt in rollout_rs.split(",") if opt.strip()))
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    for option in options:
        if option not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {option}. Must be one of {sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
    return options


def _rs_statistic(
    option: str, divergences: dict[str, torch.Tensor], response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token statistic [B, T], per-sequence statistic [B] or None) of one option."""
    token = divergences[option[-2:]]
    if option in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS:
        return token, None
    how = option.split("_")[1]
    if how == "sum":
        seq = masked_sum(token, response_mask, -1)
    elif how == "mean":
        seq = masked_mean(token, response_mask, -1)
    else:  # max over the row's tokens; a row without tokens gets 0
        filled = token.masked_fill(~response_mask.bool(), float("-inf")).max(dim=-1).values
        seq = torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)
    return seq.unsqueeze(-1).expand_as(response_mask), seq


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Response mask [B, T] with rejected tokens zeroed, and ``rollout_rs_*`` metrics.

    Options (comma separated; a token is kept only if every option keeps it), with
    x = clamp(log_ratio, +-20): k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x per token;
    token_kN judges each token, seq_sum_kN / seq_mean_kN / seq_max_kN the row's sum,
    mean or max of it (the whole row is kept or dropped). kN (N > 1) keeps values <=
    upper; k1 keeps values in [log(lower), log(upper)] (ratio bounds "lower_upper").
    """
    options = _rs_options(rollout_rs)
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    x = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    divergences = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.exp(x) - 1.0 - x}
    valid = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        upper, lower = thresholds[option]["upper"], thresholds[option]["lower"]
        is_k1 = option.endswith("k1")
        stat, seq_stat = _rs_statistic(option, divergences, response_mask)
        if is_k1:
            low_bound, high_bound = math.log(lower), math.log(upper)
            keep_bool = (stat >= low_bound) & (stat <= high_bound)
        else:
            low_bound, high_bound = 0.0, upper
            keep_bool = stat <= upper
        keep = keep_bool.to(log_ratio.dtype)
        combined = combined * keep
        metrics.update(
            compute_rs_metrics(
                option, stat, response_mask, seq_valid,
                level="token" if option in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS else "sequence",
                per_sequence_values=seq_stat, rollout_rs_threshold=high_bound,
                rollout_rs_threshold_lower=low_bound, apply_lower_threshold=is_k1,
            )
        )  # fmt: skip
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep, response_mask).item()
        seq_kept = (~(~keep_bool & valid)).all(dim=-1).to(log_ratio.dtype)
        n_valid = seq_valid.float().sum()
        dropped = ((1.0 - seq_kept) * seq_valid.float()).sum() / n_valid if n_valid > 0 else torch.tensor(0.0)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = float(dropped)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    lost = (~((combined > 0.5) & valid) & valid).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = lost.float().mean().item()
    return (response_mask * combined).to(response_mask.dtype), metrics


def _is_batch_mean(weights: torch.Tensor, response_mask: torch.Tensor, rollout_is: str) -> torch.Tensor:
    """Mean weight over tokens (token level) or over rows (sequence level), all dp ranks."""
    mask = response_mask.to(weights.dtype)
    if rollout_is == "token":
        values, weight_mask = weights, mask
    else:
        values = masked_mean(weights, response_mask, -1)
        weight_mask = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
    total = torch.stack([(values * weight_mask).sum(), weight_mask.sum()])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    if rollout_is == "token":
        return total[0] / (total[1] + 1e-8)
    return total[0] / total[1].clamp_min(1e-8)


def _is_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str, upper: float, lower: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(truncated or masked weights, raw weights, the log-ratio they came from): the arithmetic of
    :func:`compute_rollout_correction_weights` without its metrics or batch normalisation."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {set(IS_LEVELS)}.")
    if rollout_is == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = masked_sum(log_ratio, response_mask, -1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_for_metrics, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        return raw.clamp(max=upper), raw, log_for_metrics
    inside = (raw >= lower) & (raw <= upper)
    return torch.where(inside, raw, torch.zeros_like(raw)), raw, log_for_metrics


def rollout_is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
) -> torch.Tensor:
    """The detached IS weights of :func:`compute_rollout_correction_weights` (no batch
    normalisation), without its metrics: for a caller inside the update, where the metrics would
    cost a host sync per micro-batch and nobody reads them."""
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    return _is_weights(log_ratio, response_mask, rollout_is, upper, lower)[0].detach()


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached IS weights [B, T] (0 on padding) and ``rollout_is_*`` metrics.

    token: w_t = exp(clamp(log_ratio_t, +-20)); sequence: every token of a row gets
    exp(clamp(sum_t log_ratio_t, +-20)). A single threshold truncates w at it (TIS);
    "lower_upper" zeroes weights outside [lower, upper] (IcePop, adds rollout_is_oob_ratio).
    With batch normalisation the weights are divided by their mean (tokens, or rows for
    sequence level; over all ranks when torch.distributed is up).
    """
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    weights, raw, log_for_metrics = _is_weights(log_ratio, response_mask, rollout_is, upper, lower)
    metrics = compute_is_metrics(weights, raw, log_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.float(), response_mask).item()
    # IS weights change the measure, not the objective: no gradient flows through them.
    weights = weights.detach()
    if rollout_is_batch_normalize:
        mean = _is_batch_mean(weights, response_mask, rollout_is)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[DataProto | None, torch.Tensor, dict[str, float]]:
    """IS weights (a DataProto with "rollout_is_weights", None when rollout_is is None),
    the response mask after rejection, and every metric prefixed ``rollout_corr/``.
    log_ratio = old_log_prob (training policy) - rollout_log_prob, all [B, T]."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    for name, tensor in (("rollout_log_prob", rollout_log_prob), ("response_mask", response_mask)):
        if tensor.shape != old_log_prob.shape:
            raise ValueError(
                f"old_log_prob shape {tuple(old_log_prob.shape)} does not match {name} shape {tuple(tensor.shape)}."
            )
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be set when rollout_rs is enabled.")
        mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    prefixed = {
        f"rollout_corr/{k}": (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()
    }
    from verl_megatron.protocol import DataProto

    proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, mask, prefixed


def compute_rollout_correction_and_add_to_batch(
    batch: DataProto, rollout_corr_config: Any
) -> tuple[DataProto, dict]:
    """Apply a rollout-correction config (rollout_is, rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold) to a batch with
    old_log_probs, rollout_log_probs and response_mask: the response mask always gets
    the rejection; "rollout_is_weights" is added when rollout_is is set."""
    proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=batch.batch["old_log_probs"],
        rollout_log_prob=batch.batch["rollout_log_probs"],
        response_mask=batch.batch["response_mask"],
        rollout_is=_cfg(rollout_corr_config, "rollout_is", None),
        rollout_is_threshold=_cfg(rollout_corr_config, "rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=_cfg(rollout_corr_config, "rollout_is_batch_normalize", False),
        rollout_rs=_cfg(rollout_corr_config, "rollout_rs", None),
        rollout_rs_threshold=_cfg(rollout_corr_config, "rollout_rs_threshold", None),
    )
    batch.batch["response_mask"] = mask
    if proto is not None:
        batch = batch.union(proto)
    return batch, metrics


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics of the current policy vs the rollout policy, ``rollout_corr/*``."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return {f"rollout_corr/{k}": v for k, v in metrics.items()}


def apply_bypass_mode(
    batch: DataProto, rollout_corr_config: Any = None, policy_loss_config: Any = None
) -> None:
    """Train against the rollout policy: old_log_probs := rollout_log_probs, and the
    policy loss becomes ``bypass_mode`` with `rollout_corr_config` (its loss_type picks
    PPO-clip or REINFORCE with IS weights). Edits `batch` and `policy_loss_config`."""
    if "rollout_log_probs" not in batch.batch:
        raise ValueError(
            "bypass_mode=True requires rollout_log_probs in batch; "
            "configure the rollout to return log-probs (calculate_log_probs=true)."
        )
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if policy_loss_config is None:
        raise ValueError(
            "apply_bypass_mode: policy_loss_config is required (the actor's policy_loss section)."
        )
    if isinstance(policy_loss_config, DictConfig):
        with open_dict(policy_loss_config):
            policy_loss_config["rollout_correction"] = rollout_corr_config
            policy_loss_config["loss_mode"] = "bypass_mode"
    elif isinstance(policy_loss_config, dict):
        policy_loss_config["rollout_correction"] = rollout_corr_config
        policy_loss_config["loss_mode"] = "bypass_mode"
    else:
        policy_loss_config.rollout_correction = rollout_corr_config
        policy_loss_config.loss_mode = "bypass_mode"
