"""Tiny random GPT-OSS checkpoints, built locally with transformers."""

from __future__ import annotations

from typing import Any

import torch

# Hidden 32, 4 heads in 2 kv groups of head 8, q/k/v/o biases and sinks; layer 0 a sliding window
# of 4 keys (the parity sequences are 5-12 tokens long), layer 1 full; 4 experts of 16, top-2, with
# biases; swiglu_limit 1.5 and alpha 1.2 so that the clamps and alpha matter at this scale; YaRN
# (factor 4, truncate=false as the released checkpoints) over an original context of 32.
GPT_OSS = dict(
    vocab_size=131, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5, swiglu_alpha=1.2,
    max_position_embeddings=128, initializer_range=0.2, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32,
    },
)  # fmt: skip


def build_gpt_oss(out_dir: str, seed: int = 0, **overrides: Any) -> Any:
    """A random GPT-OSS saved to ``out_dir``: sinks, biases and norms random too (transformers starts
    some at 0 / 1, which would hide an unloaded or misplaced one)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(**{**GPT_OSS, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 or name.endswith("_bias"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    model.save_pretrained(out_dir)
    return model
