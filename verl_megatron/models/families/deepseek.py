"""DeepSeek-V3 (``deepseek_v3``; Kimi-K2 ships the same architecture) in megatron's terms.

Multi-latent attention (megatron's ``MLASelfAttention``, ``MLATransformerConfig``): every HF
projection is one megatron linear, copied as it is (no fusing):

=============================  ==========================================
HF ``self_attn.``              megatron ``self_attention.``
=============================  ==========================================
``q_a_proj`` / ``q_proj``      ``linear_q_down_proj`` / ``linear_q_proj``
``q_a_layernorm``              ``q_layernorm``
``q_b_proj``                   ``linear_q_up_proj``
``kv_a_proj_with_mqa``         ``linear_kv_down_proj`` ([kv_lora_rank; rope dims])
``kv_a_layernorm``             ``kv_layernorm``
``kv_b_proj``                  ``linear_kv_up_proj`` (per head [nope; v])
``o_proj``                     ``linear_proj``
=============================  ==========================================

megatron's local spec makes the two down projections column-parallel (each tp rank computes a
slice and gathers it), so ``q_lora_rank`` and ``kv_lora_rank + qk_rope_head_dim`` must split
over tp. Rotary dimensions: HF's ``rope_interleave=true`` (every released DeepSeek-V3/Kimi-K2
config) rotates interleaved pairs; megatron's MLA de-interleaves the rotary part first, the
same dot products. ``rope_interleave=false`` is refused. YaRN (``rope_type: yarn``) maps onto
megatron's ``YarnRotaryEmbedding`` and the softmax scale ``mscale(factor, mscale_all_dim)^2 /
sqrt(q_head_dim)``, as transformers' ``yarn_apply_mscale``.

Routing (megatron's ``TopKRouter``; read by ``models.moe.read_sigmoid_moe``): sigmoid scores; ``e_score_correction_bias`` is megatron's
``router.expert_bias`` buffer (``moe_router_enable_expert_bias``), added for the choice of
experts only; group-limited top-k over ``n_group`` groups keeping ``topk_group``; the chosen
scores are renormalised and multiplied by ``routed_scaling_factor``; ``n_shared_experts`` shared
experts of ``moe_intermediate_size`` each form one megatron shared expert; the first
``first_k_dense_replace`` layers are dense MLPs. Two differences are refused rather than
approximated: megatron ranks a group by the sum of its top ``topk / topk_group`` scores where
transformers sums the top 2 (so with several groups ``num_experts_per_tok / topk_group`` must be
2, as in DeepSeek-V3's 8 / 4), and megatron always renormalises sigmoid top-k scores
(``norm_topk_prob`` must be true, as in every released config).

Aux-loss-free balancing: after each optimizer step megatron's ``finalize_model_grads`` moves
every expert's bias by ``moe_router_bias_update_rate`` (default here
:data:`EXPERT_BIAS_UPDATE_RATE`, DeepSeek-V3's gamma; 0 freezes the biases:
``model.override_transformer_config.moe_router_bias_update_rate=0``) towards the mean load of
the tokens routed in that step, counted over every tp x dp x cp rank. The biases are
exported back as ``e_score_correction_bias``.

Multi-token prediction: checkpoints with ``num_nextn_predict_layers`` > 0 store the MTP module
as ``model.layers.<num_hidden_layers>.*``; transformers ignores those tensors and so does this
loader: they are not trained and not exported (a trained policy's export has no MTP layer, which
only speculative decoding reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_megatron.errors import ModelConfigError
from verl_megatron.models.moe import EXPERT_BIAS_UPDATE_RATE

MLA_MODEL_TYPES = ("deepseek_v3",)
__all__ = ["EXPERT_BIAS_UPDATE_RATE", "MLAArchitecture", "read_mla_architecture"]

# megatron ``self_attention.<suffix>`` -> HF ``self_attn.<suffix>`` (all copied whole; TE's fused
# norm-linear names appear too).
_MLA_RULES = {
    "linear_q_proj.weight": "q_proj.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.layer_norm_weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.layer_norm_weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
}


# megatron's YaRN fields (MLATransformerConfig) <- HF ``rope_parameters`` key, default.
_YARN_FIELDS = (
    ("rotary_scaling_factor", "factor", None),
    ("original_max_position_embeddings", "original_max_position_embeddings", None),
    ("beta_fast", "beta_fast", 32.0),
    ("beta_slow", "beta_slow", 1.0),
    ("mscale", "mscale", 1.0),
    ("mscale_all_dim", "mscale_all_dim", 0.0),
)
# megatron's YarnRotaryEmbedding argument <- MLATransformerConfig field, where they differ.
YARN_ROTARY_ARGS = {"scaling_factor": "rotary_scaling_factor"}


# MLATransformerConfig field <- MLAArchitecture attribute. The core attention's output width is
# heads * kv_channels: the value heads'.
_MLA_FIELDS = {
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "kv_channels": "v_head_dim",
    "rotary_base": "rope_theta",
}  # fmt: skip


@dataclass(frozen=True)
class MLAArchitecture:
    """Multi-latent attention shapes of a checkpoint."""

    q_lora_rank: int | None
    """Rank of the query compression (None: a plain ``q_proj``)."""
    kv_lora_rank: int
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: int
    """Per-head query/key dimensions without rotary embedding."""
    qk_rope_head_dim: int
    """Per-head rotary dimensions (the rotary key part is shared by all heads)."""
    v_head_dim: int
    """Per-head value dimensions."""
    rope_theta: float
    yarn: dict[str, float] | None = None
    """YaRN scaling as megatron's MLATransformerConfig fields (None: plain rotary)."""

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def read_mla_architecture(hf_config: Any) -> MLAArchitecture | None:
    """The MLA facts of ``hf_config`` (None for a model without multi-latent attention)."""
    model_type = hf_config.model_type
    if model_type not in MLA_MODEL_TYPES:
        return None
    if not bool(getattr(hf_config, "rope_interleave", True)):
        raise ModelConfigError(
            f"{model_type}: rope_interleave=false is not supported (megatron's MLA rotates interleaved pairs)"
        )
    if bool(getattr(hf_config, "attention_bias", False)):
        raise ModelConfigError(
            f"{model_type}: attention_bias=true is not supported (megatron's MLA has no biases)"
        )
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ModelConfigError(f"{model_type} config has no rope_parameters.rope_theta")
    q_lora = getattr(hf_config, "q_lora_rank", None)
    return MLAArchitecture(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(hf_config.kv_lora_rank),
        qk_nope_head_dim=int(hf_config.qk_nope_head_dim),
        qk_rope_head_dim=int(hf_config.qk_rope_head_dim),
        v_head_dim=int(hf_config.v_head_dim),
        rope_theta=float(theta),
        yarn=_read_yarn(model_type, params),
    )


def _read_yarn(model_type: str, params: dict) -> dict[str, float] | None:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ModelConfigError(
            f"{model_type}: rope type {rope_type!r} is not supported; supported: default, yarn"
        )
    if params.get("attention_factor") is not None:
        raise ModelConfigError(
            f"{model_type}: rope_parameters.attention_factor is not supported (megatron derives it)"
        )
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if bool(mscale) != bool(mscale_all_dim):
        # transformers then ignores the one given for the rotary scale but not for the softmax
        # scale; megatron uses both everywhere: refused rather than silently different.
        raise ModelConfigError(
            f"{model_type}: rope_parameters has mscale={mscale} with mscale_all_dim={mscale_all_dim}; "
            "set both or neither"
        )
    if params.get("truncate") is False:
        raise ModelConfigError(f"{model_type}: rope_parameters.truncate=false is not supported")
    yarn = {}
    for field, key, default in _YARN_FIELDS:
        value = params.get(key) or default
        if value is None:
            raise ModelConfigError(f"{model_type}: rope_parameters.{key} is required for yarn")
        yarn[field] = int(value) if field == "original_max_position_embeddings" else float(value)
    return yarn


def mla_transformer_config(mla: MLAArchitecture, use_te: bool) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of multi-latent attention (merged into the others)."""
    kwargs: dict[str, Any] = {field: getattr(mla, attr) for field, attr in _MLA_FIELDS.items()}
    kwargs.update(
        multi_latent_attention=True,
        # The q / kv latent norms are megatron's q_layernorm / kv_layernorm (identity without this).
        qk_layernorm=True,
        rope_type="rope" if mla.yarn is None else "yarn",
        rotary_scaling_factor=1.0,
        # megatron's fused MLA rotary kernel exists for YaRN only (and on CUDA).
        apply_rope_fusion=use_te and mla.yarn is not None,
    )
    kwargs.update(mla.yarn or {})
    return kwargs


def check_mla_split(mla: MLAArchitecture, num_heads: int, tp: int) -> None:
    """The column-parallel down projections of the local spec split their outputs over tp."""
    widths = [("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim)]
    if mla.q_lora_rank:
        widths.append(("q_lora_rank", mla.q_lora_rank))
    for name, width in widths:
        if width % tp:
            raise ModelConfigError(f"{name}={width} is not divisible by tp={tp} (megatron splits it over tp)")


def hf_mla_names(rest: str) -> tuple[str, tuple[str, ...]] | None:
    """(kind, HF layer suffixes) of MLA parameter ``self_attention.<...>`` of a layer, or None."""
    suffix = _MLA_RULES.get(rest.removeprefix("self_attention."))
    if not rest.startswith("self_attention.") or suffix is None:
        return None
    return "copy", (f"self_attn.{suffix}",)


def check_family_features(model_type: str, *, lora_rank: int, bitwise_parity: bool, cp: int) -> None:
    """Refuse the trainer features the DeepSeek-V3 / GLM-4.5 families do not have (or have not been
    verified with) yet: ModelConfigError naming the key."""
    if model_type not in ("deepseek_v3", "glm4_moe"):
        return
    what = (
        "multi-latent attention (deepseek_v3)"
        if model_type == "deepseek_v3"
        else "glm4_moe (not verified yet)"
    )
    if lora_rank > 0:
        raise ModelConfigError(
            f"model.lora_rank > 0: LoRA is not supported with {what}: adapters exist for grouped-query "
            "attention (q/k/v/o_proj) and dense MLPs, not for MLA's q_a_proj/q_b_proj/kv_a_proj_with_mqa/"
            "kv_b_proj or routed experts; set model.lora_rank=0"
        )
    if bitwise_parity:
        raise ModelConfigError(
            f"rollout.bitwise_parity=true is not supported with {what}: set it to false "
            "(algorithm.rollout_correction corrects the rollout/training mismatch)"
        )
    if cp > 1:
        raise ModelConfigError(
            f"parallel.cp={cp}: context parallelism is not supported with {what}; use parallel.cp=1"
        )


def mla_hf_shapes(mla: MLAArchitecture, prefix: str, heads: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """HF attention tensor shapes of one MLA layer (``prefix``: ``model.layers.<i>.self_attn``)."""
    kv_width = mla.kv_lora_rank + mla.qk_rope_head_dim
    shapes = {
        "kv_a_proj_with_mqa.weight": (kv_width, hidden),
        "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        "o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank:
        shapes["q_a_proj.weight"] = (mla.q_lora_rank, hidden)
        shapes["q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes["q_b_proj.weight"] = (heads * mla.q_head_dim, mla.q_lora_rank)
    else:
        shapes["q_proj.weight"] = (heads * mla.q_head_dim, hidden)
    return {f"{prefix}.{name}": shape for name, shape in shapes.items()}
