"""GPT-OSS (``gpt_oss``) in megatron's terms.

Attention: grouped-query attention with biases on q/k/v and o_proj, a learnable *sink* logit per
head (HF ``self_attn.sinks``: one extra softmax column whose probability is dropped, so a head may
attend to nothing), and sliding-window layers alternating with full ones (HF ``layer_types``,
``sliding_window``: a query sees itself and the ``sliding_window - 1`` keys before it). megatron
0.16's own sink (``softmax_type='learnable'``) allocates on CUDA and its local attention replaces
the padding mask by the window, so the local spec uses :class:`~verl_megatron.models.families.
gpt_oss_layers.SinkWindowAttention`: the sinks are its ``softmax_offset`` parameter (split over
tp by head, megatron's name) and the window of each layer an explicit constructor argument.
The arithmetic is :func:`attend_with_sinks`, shared with the native rollout's cached decoding.

Rotary: HF's ``yarn`` (with ``truncate``) frequencies replace the plain ones of megatron's rotary
table (:func:`yarn_inv_freq`); YaRN's attention factor, which transformers multiplies into cos and
sin, is the softmax scale ``factor^2 / sqrt(head_dim)`` (the same scores).

Experts (megatron's MoE layer, softmax top-k then renormalised: HF's top-k-then-softmax router
with ``router.bias``): each expert has biases on its [gate; up] and down projections, which
megatron's experts take with ``add_bias_linear`` (expert tp must be 1) and scale the down bias by
the routing weight as transformers does. The clamped SwiGLU is megatron's ``glu`` with
``activation_func_clamp_value`` = ``swiglu_limit`` (gate clamped above, up on both sides),
``glu_linear_offset`` = 1 (``up + 1``) and the activation ``g * sigmoid(swiglu_alpha * g)``.
transformers stores each layer's experts stacked and transposed: ``experts.gate_up_proj``
[E, H, 2I] with gate and up *interleaved* along the last axis, ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; :func:`expert_to_megatron` /
:func:`expert_to_hf` move one expert's slice, and the exporter stacks the slices back.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.errors import ModelConfigError
from verl_megatron.models.moe import MoEArchitecture

GPT_OSS_MODEL_TYPES = ("gpt_oss",)
_LAYER_TYPES = {"sliding_attention", "full_attention"}
# megatron's local expert parameter -> (kind, HF stacked tensor suffix).
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)$")
_EXPERT_NAMES = {
    ("1", "weight"): ("oss_fc1_weight", "gate_up_proj"),
    ("1", "bias"): ("oss_fc1_bias", "gate_up_proj_bias"),
    ("2", "weight"): ("oss_fc2_weight", "down_proj"),
    ("2", "bias"): ("oss_fc2_bias", "down_proj_bias"),
}
_COPY_NAMES = {
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
}


@dataclass(frozen=True)
class GptOssArchitecture:
    """The GPT-OSS facts beyond a grouped-query MoE model."""

    layer_windows: tuple[int | None, ...]
    """Per layer: keys a query sees in a sliding-window layer (itself included), None: all."""
    swiglu_alpha: float
    swiglu_limit: float
    rope_theta: float
    attention_factor: float = 1.0
    """YaRN's scale of cos and sin (1 without YaRN)."""
    yarn: tuple[float, float, float, int, bool] | None = None
    """(factor, beta_fast, beta_slow, original_max_position_embeddings, truncate); None: plain rotary."""


def read_gpt_oss_architecture(hf_config: Any) -> GptOssArchitecture | None:
    """The GPT-OSS facts of ``hf_config`` (None for another model type)."""
    if hf_config.model_type not in GPT_OSS_MODEL_TYPES:
        return None
    if not bool(getattr(hf_config, "attention_bias", True)):
        raise ModelConfigError(
            "gpt_oss: attention_bias=false is not supported (megatron's add_bias_linear gives o_proj and the "
            "experts biases together)"
        )
    layers = int(hf_config.num_hidden_layers)
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(hf_config, "sliding_window", None)
    if len(types) != layers or set(types) - _LAYER_TYPES:
        raise ModelConfigError(
            f"gpt_oss: layer_types={types} must list {layers} entries of {sorted(_LAYER_TYPES)}"
        )
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ModelConfigError(f"gpt_oss: sliding_window={window!r} must be a positive integer")
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelConfigError("gpt_oss config has no rope_parameters.rope_theta")
    factor, yarn = _read_yarn(params, hf_config)
    return GptOssArchitecture(
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        swiglu_alpha=float(hf_config.swiglu_alpha),
        swiglu_limit=float(hf_config.swiglu_limit),
        rope_theta=float(theta),
        attention_factor=factor,
        yarn=yarn,
    )


def _read_yarn(params: dict, hf_config: Any) -> tuple[float, tuple | None]:
    """(attention factor, yarn tuple) as transformers reads ``rope_parameters``."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return 1.0, None
    if rope_type != "yarn":
        raise ModelConfigError(f"gpt_oss: rope type {rope_type!r} is not supported; supported: default, yarn")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or hf_config.max_position_embeddings / original)
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    elif attention is None:
        attention = _yarn_mscale(factor, 1.0)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    return float(attention), (factor, beta_fast, beta_slow, original, bool(params.get("truncate", True)))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(gpt: GptOssArchitecture, dim: int) -> torch.Tensor | None:
    """YaRN's rotary frequencies [dim / 2] (float32) as transformers computes them; None without YaRN.

    Frequencies rotating more than ``beta_fast`` times over the original context keep their
    value, those rotating fewer than ``beta_slow`` times are divided by ``factor``, and a linear
    ramp over the dimension index blends the two in between (the bounds rounded outwards with
    ``truncate``).
    """
    if gpt.yarn is None:
        return None
    factor, beta_fast, beta_slow, original, truncate = gpt.yarn
    base = gpt.rope_theta

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled frequency
    plain = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scaled = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return scaled * (1 - keep) + plain * keep


def read_gpt_oss_moe(hf_config: Any, num_layers: int) -> MoEArchitecture:
    """GPT-OSS's router and experts: every layer a mixture of experts."""
    num_experts, topk = int(hf_config.num_local_experts), int(hf_config.num_experts_per_tok)
    if not 0 < topk <= num_experts:
        raise ModelConfigError(
            f"gpt_oss: num_local_experts={num_experts} with num_experts_per_tok={topk}: need 0 < top-k <= experts"
        )
    coeff = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    return MoEArchitecture(
        num_experts=num_experts,
        topk=topk,
        ffn_hidden_size=int(hf_config.intermediate_size),
        norm_topk_prob=True,  # softmax over the top-k logits
        layer_pattern=(1,) * num_layers,
        aux_loss_coeff=coeff,
        aux_loss_enabled=bool(getattr(hf_config, "output_router_logits", False)) and coeff > 0,
    )


def gated_activation(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation ``x * sigmoid(alpha * x)`` (megatron's glu multiplies it by up + 1)."""
    return x * torch.sigmoid(alpha * x)


def gpt_oss_transformer_config(gpt: GptOssArchitecture, head_dim: int, use_te: bool) -> dict[str, Any]:
    """The TransformerConfig fields of GPT-OSS (merged over the MoE ones)."""
    if use_te:
        raise ModelConfigError(
            "gpt_oss with model.use_te=true is not supported yet (the sinks and sliding windows are "
            "implemented for megatron's local spec); set model.use_te=false"
        )
    return dict(
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=functools.partial(gated_activation, alpha=gpt.swiglu_alpha),
        activation_func_clamp_value=gpt.swiglu_limit,
        glu_linear_offset=1.0,
        bias_activation_fusion=False,
        softmax_scale=gpt.attention_factor**2 / math.sqrt(head_dim),
    )


def hf_gpt_oss_names(layer: int, rest: str) -> tuple | None:
    """HFMapping fields (kind, HF names, export, optional, expert) of layer parameter ``rest``, or None."""
    prefix = f"model.layers.{layer}"
    if rest in _COPY_NAMES:
        return "copy", (f"{prefix}.{_COPY_NAMES[rest]}",)
    match = _EXPERT_RE.match(rest)
    if match is None:
        return None
    kind, suffix = _EXPERT_NAMES[(match.group(2), match.group(3))]
    return kind, (f"{prefix}.mlp.experts.{suffix}",), True, False, int(match.group(1))


def expert_to_megatron(kind: str, stacked: torch.Tensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s megatron tensor from HF's stacked one (gate/up de-interleaved into [gate; up])."""
    part = stacked[expert]
    if kind == "oss_fc1_weight":  # [H, 2I] interleaved -> [2I, H]
        return torch.cat([part[:, 0::2], part[:, 1::2]], dim=1).t()
    if kind == "oss_fc1_bias":
        return torch.cat([part[0::2], part[1::2]])
    return part.t() if kind == "oss_fc2_weight" else part


def expert_to_hf(kind: str, whole: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`expert_to_megatron`: one expert's slice of HF's stacked tensor."""
    if kind == "oss_fc1_weight":
        gate, up = whole.t().chunk(2, dim=1)
        return torch.stack([gate, up], dim=-1).reshape(gate.shape[0], -1)
    if kind == "oss_fc1_bias":
        return torch.stack(whole.chunk(2), dim=-1).reshape(-1)
    return whole.t() if kind == "oss_fc2_weight" else whole


class ExpertStacker:
    """Collects each expert's slice of a stacked HF tensor; yields the stack once all are in."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, expert: int, part: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = self.parts.setdefault(name, {})
        parts[expert] = part
        if len(parts) < self.num_experts:
            return []
        del self.parts[name]
        return [(name, torch.stack([parts[e] for e in range(self.num_experts)]))]


def gpt_oss_hf_shapes(arch: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """HF shapes of layer ``layer``'s sinks, router and stacked experts (``arch``: HFArchitecture)."""
    moe, h = arch.moe, arch.hidden_size
    e, i, prefix = moe.num_experts, moe.ffn_hidden_size, f"model.layers.{layer}"
    return {
        f"{prefix}.self_attn.sinks": (arch.num_attention_heads,),
        f"{prefix}.mlp.router.weight": (e, h), f"{prefix}.mlp.router.bias": (e,),
        f"{prefix}.mlp.experts.gate_up_proj": (e, h, 2 * i), f"{prefix}.mlp.experts.gate_up_proj_bias": (e, 2 * i),
        f"{prefix}.mlp.experts.down_proj": (e, i, h), f"{prefix}.mlp.experts.down_proj_bias": (e, h),
    }  # fmt: skip


def window_allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: query_pos [..., sq, 1], key_pos [..., 1, sk] -> bool."""
    allowed = key_pos <= query_pos
    return allowed if window is None else allowed & (query_pos - key_pos < window)


def attend_with_sinks(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
    scale: float, sinks: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Softmax attention with one sink logit per head.

    query [b, heads, sq, d], keys / values [b, groups, sk, d] (heads group-major), allowed bool
    broadcastable to [b, heads, sq, sk], sinks [heads] -> [b, heads, sq, d]. The sink column takes
    part in the softmax and is dropped; a query that sees no key gets zeros.
    """
    per_group = query.shape[1] // keys.shape[1]
    if per_group > 1:
        keys, values = keys.repeat_interleave(per_group, dim=1), values.repeat_interleave(per_group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def check_gpt_oss_features(model_type: str, *, lora_rank: int, bitwise_parity: bool, cp: int) -> None:
    """Refuse the trainer features GPT-OSS does not have yet: ModelConfigError naming the key."""
    if model_type not in GPT_OSS_MODEL_TYPES:
        return
    refusals = (
        (lora_rank > 0, f"model.lora_rank={lora_rank}: LoRA is not supported with gpt_oss (adapters exist "
         "for dense projections, not for its biased stacked experts); set model.lora_rank=0"),
        (bitwise_parity, "rollout.bitwise_parity=true is not supported with gpt_oss (the batch-invariant "
         "attention has no sinks or sliding windows); set it to false"),
        (cp > 1, f"parallel.cp={cp}: context parallelism is not supported with gpt_oss; use parallel.cp=1"),
    )  # fmt: skip
    for refused, message in refusals:
        if refused:
            raise ModelConfigError(message)
