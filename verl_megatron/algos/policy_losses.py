"""Policy-gradient losses, dispatched by name (verl's `actor.policy_loss.loss_mode`).

Every registered loss has verl's call shape

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
       rollout_is_weights=None, *, global_batch_info=None) -> (loss, metrics)

with [B, T] tensors, a scalar loss and a dict of float metrics ("actor/..."). `config`
is any object with verl's actor field names, read with getattr: clip_ratio,
clip_ratio_low, clip_ratio_high, clip_ratio_c, tau_pos, tau_neg, and a `policy_loss`
sub-config (clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef).

Global counts for data/pipeline parallelism (see `agg_loss`) come from the mapping
`global_batch_info` with keys dp_size, batch_num_tokens, global_batch_size,
loss_scale_factor (and agg_loss's `robust`): the keyword argument if given, else
`config.global_batch_info` as in verl 0.9, else none (single-rank normalisation).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.algos.aggregation import agg_loss
from verl_megatron.utils.torch_functional import masked_mean

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "LossCall",
    "PolicyLossFn",
    "compute_policy_loss",
    "compute_policy_loss_cispo",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "get_policy_loss_fn",
    "global_batch_kwargs",
    "metrics_on_device",
    "policy_loss",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}

# exp() of a log-ratio beyond +-20 overflows float16/bfloat16 ranges and means the
# sample is hopelessly off-policy anyway; verl clamps there.
_MAX_LOG_RATIO = 20.0
# GSPO clamps the (sequence) log-ratio from above only, at verl's value.
_GSPO_MAX_LOG_RATIO = 10.0
_GLOBAL_BATCH_KEYS = (
    "dp_size",
    "batch_num_tokens",
    "global_batch_size",
    "loss_scale_factor",
    "robust",
)


def core_registry(name: str, default: dict) -> dict:
    """The registry `name` as `core_algos` holds it now, else `default`.

    verl's users (and verl's tests) rebind e.g. ``core_algos.POLICY_LOSS_REGISTRY`` to
    a new dict; registering and looking up through the module attribute makes the
    rebound dict the one in use. While core_algos is still importing, `default` is it.
    """
    core = sys.modules.get("verl_megatron.algos.core_algos")
    return getattr(core, name, default) if core is not None else default


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (a later registration replaces it)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        core_registry("POLICY_LOSS_REGISTRY", POLICY_LOSS_REGISTRY)[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`; ValueError listing the known names otherwise."""
    registry = core_registry("POLICY_LOSS_REGISTRY", POLICY_LOSS_REGISTRY)
    if name not in registry:
        raise ValueError(f"Unsupported loss mode: {name!r}. Supported modes are: {sorted(registry)}")
    return registry[name]


def cfg_value(config: Any, name: str, default: Any) -> Any:
    """`config.name`, or `default` when config is None, lacks the field, or holds None."""
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


def global_batch_kwargs(config: Any, global_batch_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The agg_loss keyword arguments for global counts (see module docstring)."""
    info = global_batch_info if global_batch_info is not None else cfg_value(config, "global_batch_info", {})
    unknown = set(info) - set(_GLOBAL_BATCH_KEYS)
    if unknown:
        raise ValueError(
            f"global_batch_info has unknown keys {sorted(unknown)}; allowed: {_GLOBAL_BATCH_KEYS}"
        )
    return {key: info[key] for key in info}


def clip_ratios(config: Any) -> tuple[float, float]:
    """(low, high) clip ranges: clip_ratio_low/high, each defaulting to clip_ratio."""
    clip_ratio = cfg_value(config, "clip_ratio", None)
    low = cfg_value(config, "clip_ratio_low", clip_ratio)
    high = cfg_value(config, "clip_ratio_high", clip_ratio)
    if low is None or high is None:
        raise ValueError("policy loss config: set clip_ratio (or both clip_ratio_low and clip_ratio_high)")
    return float(low), float(high)


def check_inputs(
    where: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
) -> None:
    """Every tensor input of a policy loss must have the [B, T] shape of response_mask."""
    named = {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "advantages": advantages,
        "rollout_is_weights": rollout_is_weights,
    }
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != response_mask.shape:
            raise ValueError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, "
                f"expected response_mask's {tuple(response_mask.shape)}"
            )


def _dual_clip_token_losses(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss with clip-higher and dual clip, plus (clipfrac, ppo_kl, clipfrac_lower)."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1.0, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_max = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(log_ratio.dtype), response_mask)

    # Dual clip bounds the loss of negative-advantage tokens whose ratio exploded.
    lower_bound = -advantages * clip_ratio_c
    clip_min = torch.minimum(lower_bound, clip_max)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        (torch.gt(clip_max, lower_bound) & negative).to(log_ratio.dtype), response_mask
    )
    token_losses = torch.where(negative, clip_min, clip_max)
    return token_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


# Set by `metrics_on_device`: metrics stay detached device tensors (no host sync per call).
_METRICS_ON_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("metrics_on_device", default=False)


@contextlib.contextmanager
def metrics_on_device():
    """Within it, the registered losses return their metrics as detached 0-d tensors, not floats.

    verl's API returns floats, one ``.item()`` (a device sync) per metric and call; the Megatron
    actor calls a loss per micro-batch, so it sums these tensors and moves them to the host once
    per mini-batch instead.
    """
    token = _METRICS_ON_DEVICE.set(True)
    try:
        yield
    finally:
        _METRICS_ON_DEVICE.reset(token)


def _metrics(**values: torch.Tensor) -> dict[str, float]:
    if _METRICS_ON_DEVICE.get():
        return {f"actor/{name}": value.detach() for name, value in values.items()}
    return {f"actor/{name}": float(value.detach().item()) for name, value in values.items()}


@dataclass(frozen=True)
class LossCall:
    """One call of a registered policy loss: verl's arguments (tensors [B, T])."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    loss_agg_mode: str
    config: Any
    rollout_is_weights: torch.Tensor | None
    global_batch_info: Mapping[str, Any] | None

    def check(self, where: str) -> None:
        """Every tensor input has the [B, T] shape of response_mask."""
        check_inputs(
            where,
            self.old_log_prob,
            self.log_prob,
            self.advantages,
            self.response_mask,
            self.rollout_is_weights,
        )

    def setting(self, name: str, default: Any) -> Any:
        """`config.name` (verl's actor field), `default` when unset."""
        return cfg_value(self.config, name, default)

    def loss_setting(self, name: str, default: Any) -> Any:
        """`config.policy_loss.name` (the loss's own knobs), `default` when unset."""
        return cfg_value(cfg_value(self.config, "policy_loss", None), name, default)

    def clip_ratios(self) -> tuple[float, float]:
        """(low, high) clip ranges (see `clip_ratios`)."""
        return clip_ratios(self.config)

    def aggregate(self, token_losses: torch.Tensor, loss_agg_mode: str | None = None) -> torch.Tensor:
        """agg_loss of `token_losses` [B, T] times the rollout IS weights (when given), with the
        call's global counts; `loss_agg_mode` overrides the call's mode."""
        return agg_loss(
            _weighted(token_losses, self.rollout_is_weights),
            self.response_mask,
            loss_agg_mode or self.loss_agg_mode,
            **global_batch_kwargs(self.config, self.global_batch_info),
        )


LossResult = tuple[torch.Tensor, dict[str, Any]]


def policy_loss(name: str, default_agg_mode: str = "token-mean") -> Callable[[Callable], PolicyLossFn]:
    """Register ``body(call: LossCall) -> (loss, metrics)`` under `name` as a loss with verl's call
    shape (module docstring); the registered function carries the body's name and docstring."""

    def decorator(body: Callable[[LossCall], LossResult]) -> PolicyLossFn:
        def loss(
            old_log_prob: torch.Tensor,
            log_prob: torch.Tensor,
            advantages: torch.Tensor,
            response_mask: torch.Tensor,
            loss_agg_mode: str = default_agg_mode,
            config: Any = None,
            rollout_is_weights: torch.Tensor | None = None,
            *,
            global_batch_info: Mapping[str, Any] | None = None,
        ) -> LossResult:
            call = LossCall(
                old_log_prob,
                log_prob,
                advantages,
                response_mask,
                loss_agg_mode,
                config,
                rollout_is_weights,
                global_batch_info,
            )
            return body(call)

        loss.__name__ = loss.__qualname__ = body.__name__
        loss.__doc__, loss.__module__ = body.__doc__, body.__module__
        return register_policy_loss(name)(loss)

    return decorator


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped objective with clip-higher and dual clip (verl's functional form).

    Inputs are [B, T]. r = exp(clamp(log_prob - old_log_prob, -20, 20)); per token
    max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 additionally capped at
    -A * clip_ratio_c. low/high default to `cliprange`.

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars.
    """
    check_inputs("compute_policy_loss", old_log_prob, log_prob, advantages, response_mask)
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError("compute_policy_loss: pass cliprange (or both cliprange_low and cliprange_high)")
    token_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _dual_clip_token_losses(
        old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c
    )
    pg_loss = agg_loss(token_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@policy_loss("vanilla")
def compute_policy_loss_vanilla(c: LossCall) -> LossResult:
    """PPO with clip-higher and dual clip (config: clip_ratio[_low/_high], clip_ratio_c=3.0)."""
    c.check("vanilla")
    low, high = c.clip_ratios()
    token_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower = _dual_clip_token_losses(
        c.old_log_prob,
        c.log_prob,
        c.advantages,
        c.response_mask,
        low,
        high,
        float(c.setting("clip_ratio_c", 3.0)),
    )
    pg_loss = c.aggregate(token_losses)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)


@policy_loss("gspo", "seq-mean-token-mean")
def compute_policy_loss_gspo(c: LossCall) -> LossResult:
    """GSPO (arXiv:2507.18071): PPO clipping of the sequence-level ratio.

    s_i = exp(mean_t (log_prob - old_log_prob)) per sequence; each token uses
    sg[s_i] * pi / sg[pi], so its value is s_i and its gradient is that of its own
    log-prob. Aggregated with `loss_agg_mode` as in verl 0.9.1 (the paper uses
    seq-mean-token-mean, the default here; verl <= 0.9.0 always used it).
    """
    c.check("gspo")
    low, high = c.clip_ratios()
    mask = c.response_mask.to(c.log_prob.dtype)
    log_ratio = c.log_prob - c.old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = c.log_prob - c.log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_MAX_LOG_RATIO))

    unclipped = -c.advantages * seq_ratio
    clipped = -c.advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_loss = c.aggregate(torch.maximum(unclipped, clipped))
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(c.log_prob.dtype), c.response_mask)
    ppo_kl = masked_mean(-log_ratio, c.response_mask)
    return pg_loss, _metrics(
        pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=torch.zeros((), device=pg_loss.device)
    )


@policy_loss("sapo", "seq-mean-token-mean")
def compute_policy_loss_sapo(c: LossCall) -> LossResult:
    """SAPO (arXiv:2511.20347): a smooth sigmoid gate instead of a hard clip.

    Per token -A * sigmoid(tau * (r - 1)) * 4 / tau, tau = config.tau_pos (1.0) when
    A > 0 else config.tau_neg (1.05); r as in vanilla. Aggregated with
    seq-mean-token-mean whatever `loss_agg_mode` says (as in verl).
    """
    c.check("sapo")
    tau_pos = torch.as_tensor(float(c.setting("tau_pos", 1.0)), dtype=c.advantages.dtype)
    tau_neg = torch.as_tensor(float(c.setting("tau_neg", 1.05)), dtype=c.advantages.dtype)
    log_ratio = torch.clamp(c.log_prob - c.old_log_prob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    taus = torch.where(c.advantages > 0, tau_pos.to(c.advantages.device), tau_neg.to(c.advantages.device))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_loss = c.aggregate(-gates * c.advantages, "seq-mean-token-mean")
    zero = torch.zeros((), device=pg_loss.device)  # with the others: no host-to-device copy later
    ppo_kl = masked_mean(-log_ratio, c.response_mask)
    return pg_loss, _metrics(pg_clipfrac=zero, ppo_kl=ppo_kl, pg_clipfrac_lower=zero)


@policy_loss("gpg")
def compute_policy_loss_gpg(c: LossCall) -> LossResult:
    """GPG: plain policy gradient -A * log_prob (no ratio, no clip); no metrics."""
    check_inputs("gpg", c.log_prob, c.log_prob, c.advantages, c.response_mask, c.rollout_is_weights)
    pg_loss = c.aggregate(-c.log_prob * c.advantages)
    return pg_loss, {}


@policy_loss("cispo")
def compute_policy_loss_cispo(c: LossCall) -> LossResult:
    """CISPO (arXiv:2506.13585): -sg(clip(r, 1 - low, 1 + high)) * A * log_prob.

    The clipped ratio is a constant weight, so every token keeps a REINFORCE gradient;
    pg_clipfrac counts tokens whose ratio was clipped.
    """
    c.check("cispo")
    low, high = c.clip_ratios()
    log_ratio = torch.clamp(c.log_prob - c.old_log_prob, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_loss = c.aggregate(-clipped_ratio.detach() * c.advantages * c.log_prob)
    pg_clipfrac = masked_mean(torch.ne(ratio, clipped_ratio).to(c.log_prob.dtype), c.response_mask)
    ppo_kl = masked_mean(-log_ratio, c.response_mask)
    return pg_loss, _metrics(
        pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=torch.zeros((), device=pg_loss.device)
    )


@policy_loss("geo_mean")
def compute_policy_loss_geo_mean(c: LossCall) -> LossResult:
    """GMPO (arXiv:2507.20673): PPO on the geometric mean of token ratios of a sequence.

    Each token log-ratio is clipped to [-low, high] on the side that matters for the
    sign of A; the sequence ratio is exp(mean_t clipped log-ratio) and the sequence
    advantage mean_t A. The loss -A_i * ratio_i is averaged over sequences
    (`loss_agg_mode` is ignored, as in verl). By default that is verl 0.9.1's plain mean
    over every row of the micro-batch (empty rows count as 0, global counts and dp_size
    are ignored, so the gradient depends on the micro-batch layout). With
    `config.policy_loss.geo_mean_valid_rows` true (the project's trainer default) rows
    without any unmasked token are left out and the mean uses global_batch_size and
    dp_size from the global counts, which makes it layout-invariant.
    Token-level rollout_is_weights enter as their per-sequence geometric mean.
    """
    c.check("geo_mean")
    low, high = c.clip_ratios()
    mask = c.response_mask.to(c.log_prob.dtype)
    log_ratio = c.log_prob - c.old_log_prob
    ppo_kl = masked_mean(-log_ratio, c.response_mask)

    sign = torch.sign(c.advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    # sign * min(sign * x, sign * clip(x)) keeps the pessimistic side for either sign of A.
    token_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    tokens = mask.sum(dim=-1)
    seq_ratio = torch.exp((token_log_ratio * mask).sum(dim=-1) / (tokens + 1e-8))
    seq_advantage = (c.advantages * mask).sum(dim=-1) / (tokens + 1e-8)
    seq_losses = -seq_advantage * seq_ratio
    if c.rollout_is_weights is not None:
        log_w = torch.log(c.rollout_is_weights + 1e-10)
        seq_losses = seq_losses * torch.exp((log_w * mask).sum(dim=-1) / (tokens + 1e-8))

    kwargs = global_batch_kwargs(c.config, c.global_batch_info)
    if c.loss_setting("geo_mean_valid_rows", False):
        kwargs.pop("batch_num_tokens", None)
        kwargs.pop("loss_scale_factor", None)
        valid = (tokens > 0).unsqueeze(-1)
        pg_loss = agg_loss(seq_losses.unsqueeze(-1), valid, "seq-mean-token-sum", **kwargs)
    else:
        pg_loss = seq_losses.mean()

    was_clipped = torch.ne(log_ratio, clamped)
    pg_clipfrac = masked_mean((was_clipped & (c.advantages > 0)).to(c.log_prob.dtype), c.response_mask)
    pg_clipfrac_lower = masked_mean((was_clipped & (c.advantages < 0)).to(c.log_prob.dtype), c.response_mask)
    return pg_loss, _metrics(pg_clipfrac=pg_clipfrac, ppo_kl=ppo_kl, pg_clipfrac_lower=pg_clipfrac_lower)
