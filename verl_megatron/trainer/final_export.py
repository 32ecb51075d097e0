"""The end-of-run export the RL and SFT loops share: the Hugging Face model and the LoRA adapter."""

from __future__ import annotations

import os
from typing import Any

import torch

from verl_megatron.distributed.parallel import Runtime

__all__ = ["export_final_model"]


def export_final_model(
    chunks: list[torch.nn.Module],
    runtime: Runtime,
    out_root: str,
    hf_config: Any,
    tokenizer: Any,
    model_cfg: Any,
) -> str:
    """``<out_root>/hf_export`` (merged weights, the tokenizer) and, with LoRA adapters,
    ``<out_root>/lora_adapter``; collective over all ranks. Returns the ``hf_export`` folder."""
    from verl_megatron.models.convert import export_hf_weights
    from verl_megatron.models.lora_export import export_final_adapter

    out_dir = os.path.join(out_root, "hf_export")
    export_hf_weights(chunks, runtime, out_dir, hf_config, tokenizer)
    export_final_adapter(chunks, runtime, out_root, model_cfg)
    return out_dir
