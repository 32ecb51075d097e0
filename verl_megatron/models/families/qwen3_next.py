"""Qwen3-Next (``qwen3_next``) in megatron's terms: gated DeltaNet layers between gated attention.

Layers follow HF's ``layer_types``: ``linear_attention`` layers hold a gated DeltaNet
(``families/qwen3_next_layers.py``: a torch form on CPU, the fla / causal-conv1d kernels on a
GPU that has them), ``full_attention`` layers megatron's self-attention with
``attention_output_gate`` (HF's ``q_proj`` yields each head's query and its sigmoid gate),
QK-norm and a partial rotary embedding (``partial_rotary_factor``, megatron's
``rotary_percent``). Every ``Qwen3NextRMSNorm`` (layer norms, q/k norms, final norm) scales by
``1 + weight`` (zero-centred): the layers use :class:`~.qwen3_next_layers.ZeroCenteredRMSNorm`,
and the weights are copied as stored (no +1 folded in, so an export is byte-identical). The MoE
block is Qwen2-MoE's: softmax top-k (renormalised when ``norm_topk_prob``) and one shared expert
scaled by ``sigmoid(shared_expert_gate(x))`` (``models/moe.py``).

DeltaNet weights (per layer; ``nk``/``nv`` key/value heads, ``r = nv / nk``, ``dk``/``dv`` head
dims). HF groups its fused projections per key head: ``in_proj_qkvz`` rows are, for each key
head, [q (dk); k (dk); v (r*dv); z (r*dv)] and ``in_proj_ba`` rows [b (r); a (r)]. megatron's
column-parallel ``in_proj`` holds on each tp rank [q; k; v; z; b; a] of that rank's heads (key
heads split evenly over tp, value heads with them), so the whole tensor is those blocks rank after
rank and depends on tp (as ``linear_fc1``'s [gate; up]). ``conv1d`` channels are HF's [q; k; v]
(all heads) and per tp rank [q; k; v] of its heads. ``A_log``, ``dt_bias`` (per value head),
``out_proj`` (row-parallel) split as stored; the gated output norm ``norm`` (``out_norm``, not
zero-centred) is replicated.

Gated attention: HF's ``q_proj`` rows are per head [query (d); gate (d)]; megatron's
``linear_qkv`` holds per key/value group [queries; gates; key; value] of the group's heads.

Qwen3.5's text decoders (``qwen3_5_text`` dense, ``qwen3_5_moe_text`` with Qwen2-MoE's block and an
always-renormalised router) have the same layers; their DeltaNet stores ``in_proj_qkv`` ([q; k; v]
of all heads), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` apart (``fused_in_proj=False``).
Their multimodal rotary sections turn text positions (the same id on every section) as the plain
rotary does. Checkpoints of the whole vision-language model (``model.language_model.*``) are not
read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.errors import ModelConfigError

# Qwen3.5's text decoders (dense, MoE) have the same layers with the DeltaNet projections stored apart.
QWEN3_5_TEXT_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
LINEAR_ATTENTION_MODEL_TYPES = ("qwen3_next", *QWEN3_5_TEXT_MODEL_TYPES)
# HF DeltaNet suffix (under ``linear_attn.``) <- megatron suffix (under ``self_attention.``).
_GDN_COPY = {
    "conv1d.weight": "conv1d.weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "out_norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}
# LinearAttentionArchitecture field <- HF config key.
_LINEAR_FIELDS = {
    "num_key_heads": "linear_num_key_heads", "num_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim", "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
}  # fmt: skip
# Mapping kinds this module converts (models/convert.py hands them here).
KINDS = ("gdn_in", "gdn_in_split", "gdn_conv", "qkv_gate")


@dataclass(frozen=True)
class LinearAttentionArchitecture:
    """Gated DeltaNet shapes of a checkpoint, and which layers have it."""

    layer_pattern: tuple[int, ...]
    """Per layer: 1 for a gated DeltaNet layer, 0 for gated full attention."""
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    norm_eps: float
    fused_in_proj: bool = True
    """Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba``; False: Qwen3.5's ``in_proj_qkv``
    ([q; k; v] of all heads, the convolution's channel order), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def read_linear_attention(hf_config: Any) -> LinearAttentionArchitecture | None:
    """The DeltaNet facts of ``hf_config`` (None for a model without linear attention)."""
    model_type = hf_config.model_type
    if model_type not in LINEAR_ATTENTION_MODEL_TYPES:
        return None
    kinds = list(hf_config.layer_types)
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown or len(kinds) != hf_config.num_hidden_layers:
        raise ModelConfigError(
            f"{model_type}: layer_types must name linear_attention or full_attention for each of the "
            f"{hf_config.num_hidden_layers} layers, got {kinds}"
        )
    arch = LinearAttentionArchitecture(
        layer_pattern=tuple(int(k == "linear_attention") for k in kinds),
        norm_eps=float(hf_config.rms_norm_eps),
        fused_in_proj=model_type == "qwen3_next",
        **{name: int(getattr(hf_config, key)) for name, key in _LINEAR_FIELDS.items()},
    )
    if arch.num_value_heads % arch.num_key_heads:
        raise ModelConfigError(
            f"{model_type}: linear_num_value_heads={arch.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={arch.num_key_heads}"
        )
    return arch


def check_linear_split(arch: LinearAttentionArchitecture, tp: int, use_te: bool) -> None:
    """DeltaNet key heads split over tp (value heads with them); the local layer spec only."""
    if arch.num_key_heads % tp:
        raise ModelConfigError(
            f"linear_num_key_heads={arch.num_key_heads} is not divisible by tp={tp} (DeltaNet heads split over tp)"
        )
    if use_te:
        raise ModelConfigError(
            "qwen3_next is built with megatron's local layer spec (zero-centred norms, torch or fla "
            "DeltaNet), not Transformer Engine's: set model.use_te=false"
        )


def check_linear_features(
    model_type: str, *, lora_rank: int, bitwise_parity: bool, cp: int, routing_replay: bool
) -> None:
    """Refuse the trainer features Qwen3-Next does not have (or has not been verified with) yet:
    ModelConfigError naming the key. Packing and dynamic batch sizes are supported (the DeltaNet
    recurrence restarts at each packed sequence)."""
    if model_type not in LINEAR_ATTENTION_MODEL_TYPES:
        return
    refused = [
        (lora_rank > 0, "model.lora_rank > 0: LoRA adapters cover q/k/v/o_proj and dense MLPs, not the "
         "DeltaNet's in_proj/out_proj or routed experts; set model.lora_rank=0"),
        (bitwise_parity, "rollout.bitwise_parity=true: the DeltaNet decode step has no batch-invariant "
         "form; set it to false (algorithm.rollout_correction corrects the mismatch)"),
        (cp > 1, f"parallel.cp={cp}: the DeltaNet recurrence is not split over context-parallel ranks; "
         "use parallel.cp=1"),
        (routing_replay, "routing replay (actor.megatron.router_replay.mode=R3 / "
         "rollout.enable_rollout_routing_replay) is not verified with qwen3_next; disable it"),
    ]  # fmt: skip
    for bad, why in refused:
        if bad:
            raise ModelConfigError(f"{why} (model_type {model_type}: gated DeltaNet layers)")


def linear_transformer_config() -> dict[str, Any]:
    """TransformerConfig fields of Qwen3-Next's full-attention layers."""
    # Zero-centred norms: megatron's torch norms refuse the flag, so a norm left unreplaced fails loudly.
    return dict(attention_output_gate=True, layernorm_zero_centered_gamma=True)


def hf_linear_names(
    arch: LinearAttentionArchitecture, layer: int, rest: str
) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF names) of parameter ``decoder.layers.<layer>.<rest>`` of a Qwen3-Next layer, or None."""
    prefix = f"model.layers.{layer}"
    if not arch.layer_pattern[layer]:
        if rest == "self_attention.linear_qkv.weight":
            names = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
            return "qkv_gate", tuple(f"{prefix}.self_attn.{n}" for n in names)
        return None
    suffix = rest.removeprefix("self_attention.")
    if suffix == "in_proj.weight":
        parts = ("qkvz", "ba") if arch.fused_in_proj else ("qkv", "z", "b", "a")
        kind = "gdn_in" if arch.fused_in_proj else "gdn_in_split"
        return kind, tuple(f"{prefix}.linear_attn.in_proj_{p}.weight" for p in parts)
    if suffix == "conv1d.weight":
        return "gdn_conv", (f"{prefix}.linear_attn.conv1d.weight",)
    if suffix in _GDN_COPY:
        return "copy", (f"{prefix}.linear_attn.{_GDN_COPY[suffix]}",)
    return None


def _gdn_in_parts(arch: LinearAttentionArchitecture, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's projection rows -> [q, k, v, z, b, a], each [rows, H] in head order."""
    if not arch.fused_in_proj:
        qkv, z, b, a = tensors
        return [*qkv.split([arch.key_dim, arch.key_dim, arch.value_dim]), z, b, a]
    qkvz, ba = tensors
    r = arch.num_value_heads // arch.num_key_heads
    nk, dk, dv = arch.num_key_heads, arch.key_head_dim, arch.value_head_dim
    q, k, v, z = qkvz.reshape(nk, -1, qkvz.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, -1, ba.shape[-1]).split([r, r], dim=1)
    return [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]


def _gdn_in_hf(arch: LinearAttentionArchitecture, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_gdn_in_parts`."""
    if not arch.fused_in_proj:
        return [torch.cat(parts[:3]), *parts[3:]]
    heads = [p.reshape(arch.num_key_heads, -1, p.shape[-1]) for p in parts]
    return [torch.cat(group, dim=1).reshape(-1, parts[0].shape[-1]) for group in (heads[:4], heads[4:])]


def to_megatron(kind: str, tensors: list[torch.Tensor], arch: Any, tp: int) -> torch.Tensor:
    """The whole megatron tensor of a Qwen3-Next mapping ``kind`` (``arch``: the HFArchitecture)."""
    linear = arch.linear
    if kind == "qkv_gate":
        q, k, v = tensors
        groups, hd = arch.num_key_value_heads, arch.head_dim
        per_head = q.reshape(arch.num_attention_heads, 2, hd, -1)
        query, gate = (per_head[:, i].reshape(groups, -1, q.shape[-1]) for i in (0, 1))
        k, v = k.reshape(groups, hd, -1), v.reshape(groups, hd, -1)
        return torch.cat([query, gate, k, v], dim=1).reshape(-1, q.shape[-1])
    if kind in ("gdn_in", "gdn_in_split"):
        parts = [p.chunk(tp) for p in _gdn_in_parts(linear, tensors)]
        return torch.cat([p[t] for t in range(tp) for p in parts])
    if kind == "gdn_conv":
        (conv,) = tensors
        parts = conv.split([linear.key_dim, linear.key_dim, linear.value_dim])
        return torch.cat([p.chunk(tp)[t] for t in range(tp) for p in parts])
    raise ValueError(f"unknown mapping kind {kind!r}")


def to_hf(kind: str, whole: torch.Tensor, arch: Any, tp: int) -> list[torch.Tensor]:
    """Inverse of :func:`to_megatron`."""
    linear = arch.linear
    if kind == "qkv_gate":
        groups, hd = arch.num_key_value_heads, arch.head_dim
        per_group = arch.num_attention_heads // groups
        query, gate, k, v = whole.reshape(groups, -1, whole.shape[-1]).split(
            [per_group * hd, per_group * hd, hd, hd], dim=1
        )
        heads = [t.reshape(arch.num_attention_heads, 1, hd, -1) for t in (query, gate)]
        return [torch.cat(heads, dim=1).reshape(-1, whole.shape[-1]), k.reshape(-1, whole.shape[-1]),
                v.reshape(-1, whole.shape[-1])]  # fmt: skip
    if kind in ("gdn_in", "gdn_in_split"):
        kd, vd, nv = linear.key_dim // tp, linear.value_dim // tp, linear.num_value_heads // tp
        shards = [shard.split([kd, kd, vd, vd, nv, nv]) for shard in whole.chunk(tp)]
        return _gdn_in_hf(linear, [torch.cat([shard[i] for shard in shards]) for i in range(6)])
    if kind == "gdn_conv":
        widths = [linear.key_dim // tp, linear.key_dim // tp, linear.value_dim // tp]
        shards = [s.split(widths) for s in whole.chunk(tp)]
        return [torch.cat([torch.cat([s[i] for s in shards]) for i in range(3)])]
    raise ValueError(f"unknown mapping kind {kind!r}")


def linear_layer_shapes(
    arch: LinearAttentionArchitecture, layer: int, shapes: dict[str, tuple[int, ...]], hidden: int
) -> dict[str, tuple[int, ...]]:
    """``shapes`` (a Llama-style layer's HF tensors) as Qwen3-Next's layer ``layer`` has them: a
    DeltaNet instead of ``self_attn``, or a ``q_proj`` twice as wide (queries and gates)."""
    attn = f"model.layers.{layer}.self_attn"
    if arch.layer_pattern[layer]:
        kept = {n: s for n, s in shapes.items() if not n.startswith(f"{attn}.")}
        return {**kept, **_linear_hf_shapes(arch, layer, hidden)}
    rows, cols = shapes[f"{attn}.q_proj.weight"]
    return {**shapes, f"{attn}.q_proj.weight": (2 * rows, cols)}


def _linear_hf_shapes(
    arch: LinearAttentionArchitecture, layer: int, hidden: int
) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of DeltaNet layer ``layer`` (its ``linear_attn`` module)."""
    prefix = f"model.layers.{layer}.linear_attn"
    nv = arch.num_value_heads
    if arch.fused_in_proj:
        shapes = {
            "in_proj_qkvz.weight": (arch.conv_dim + arch.value_dim, hidden),
            "in_proj_ba.weight": (2 * nv, hidden),
        }
    else:
        shapes = {"in_proj_qkv.weight": (arch.conv_dim, hidden), "in_proj_z.weight": (arch.value_dim, hidden),
                  "in_proj_b.weight": (nv, hidden), "in_proj_a.weight": (nv, hidden)}  # fmt: skip
    shapes |= {
        "conv1d.weight": (arch.conv_dim, 1, arch.conv_kernel),
        "dt_bias": (arch.num_value_heads,),
        "A_log": (arch.num_value_heads,),
        "norm.weight": (arch.value_head_dim,),
        "out_proj.weight": (hidden, arch.value_dim),
    }
    return {f"{prefix}.{name}": shape for name, shape in shapes.items()}
