"""Tiny random checkpoints of the newer model families (DeepSeek-V3, GLM-4.5), built locally with transformers."""

from __future__ import annotations

from typing import Any

import torch

YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
}  # fmt: skip

# Hidden 64, 4 heads with q/kv latents of 48/32, nope 16 + rope 8 per query/key head, value 16;
# 8 routed experts in 4 groups (2 kept), top-4 (4 / 2 = 2 per group, transformers' top-2 rule),
# one shared expert, routing weights x 2.5, the first layer dense.
DEEPSEEK_V3 = dict(
    vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=128, initializer_range=0.2, bos_token_id=None,
    eos_token_id=1, pad_token_id=0, num_nextn_predict_layers=0,
)  # fmt: skip


# GLM-4.5's layout: grouped-query attention (4 heads, 2 kv groups, head 16) with q/k/v biases and
# QK-norm, half of each head rotating; the DeepSeek-V3 routing above.
GLM4_MOE = dict(
    vocab_size=131, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
    n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=4, topk_group=2,
    num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128,
    initializer_range=0.2, bos_token_id=None, eos_token_id=1, pad_token_id=0, num_nextn_predict_layers=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip


def build_deepseek_v3(out_dir: str, seed: int = 0, **overrides: Any) -> Any:
    """A random DeepSeek-V3 saved to ``out_dir`` (see :func:`build_sigmoid_moe`)."""
    from transformers import DeepseekV3Config

    return build_sigmoid_moe(out_dir, DeepseekV3Config(**{**DEEPSEEK_V3, **overrides}), seed)


def build_glm4_moe(out_dir: str, seed: int = 0, **overrides: Any) -> Any:
    """A random GLM-4.5 (glm4_moe) saved to ``out_dir`` (see :func:`build_sigmoid_moe`)."""
    from transformers import Glm4MoeConfig

    return build_sigmoid_moe(out_dir, Glm4MoeConfig(**{**GLM4_MOE, **overrides}), seed)


def build_sigmoid_moe(out_dir: str, config: Any, seed: int) -> Any:
    """A random model of ``config`` saved to ``out_dir``: norms, expert biases and 1-d weights random
    too (transformers starts them at 1 / 0, which would hide a swapped norm or an unloaded bias)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # Large enough to change which experts are chosen.
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)
    model.eval()
    model.save_pretrained(out_dir)
    return model


# The actor tests' DeepSeek-V3 (vocabulary 63 as tests/test_actor_update.py's batch): hidden 32,
# q/kv latents 16/16, nope 8 + rope 8, value 8; layer 0 dense, layer 1 with 8 experts in 4 groups.
DEEPSEEK_V3_ACTOR = dict(
    vocab_size=63, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8,
    qk_nope_head_dim=8, initializer_range=0.1,
)  # fmt: skip
