"""Tiny random Qwen3-Next checkpoints (gated DeltaNet + gated attention + MoE), built locally."""

from __future__ import annotations

from typing import Any

from tests.family_models import build_sigmoid_moe

# 4 layers: DeltaNet, gated attention, DeltaNet, gated attention (each pipeline stage of pp=2 has
# both); DeltaNet with 2 key heads and 4 value heads of 8; attention with 4 heads, 2 kv groups of
# 16, a quarter of each head rotating; layer 0 a dense MLP, the others 4 experts (top-2) and a
# gated shared expert.
QWEN3_NEXT = dict(
    vocab_size=131, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=128, initializer_range=0.2, bos_token_id=None, eos_token_id=1,
    pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)  # fmt: skip


def build_qwen3_next(out_dir: str, seed: int = 0, **overrides: Any) -> Any:
    """A random Qwen3-Next saved to ``out_dir``; norms, A_log, dt_bias random too."""
    from transformers import Qwen3NextConfig

    return build_sigmoid_moe(out_dir, Qwen3NextConfig(**{**QWEN3_NEXT, **overrides}), seed)


def build_qwen3_5(out_dir: str, moe: bool, seed: int = 0, **overrides: Any) -> Any:
    """A random Qwen3.5 text decoder (``qwen3_5_moe_text`` or the dense ``qwen3_5_text``) of the same
    shapes: the DeltaNet projections stored apart (in_proj_qkv / z / b / a)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    qwen3_next_only = ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")
    spec = {k: v for k, v in QWEN3_NEXT.items() if k not in qwen3_next_only}
    config_class = Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig
    return build_sigmoid_moe(out_dir, config_class(**{**spec, **overrides}), seed)
