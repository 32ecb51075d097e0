"""Qwen3-Next in the native decoder: gated DeltaNet states and gated attention output.

A DeltaNet layer has no keys or values to cache. Its per-layer slot in the decoder's cache holds
instead the two states that carry a sequence forward (``models/families/qwen3_next_layers.py``):
the last K-1 inputs of the causal convolution [B, C/tp, K-1] and the recurrent state
[B, nv/tp, dk, dv] (float32). Both are batch-first, so the decoder's ``reorder`` (n samples per
prompt, dropping finished rows) selects their rows as it does keys and values. Each step runs the
layer's own projections with the torch convolution and gated delta rule from the states and
writes the new states in place.

Left-padded prompts: padding tokens enter the prefill with zero q/k/v, beta and decay, so the
recurrent state and the convolution's history are still zero when a row's first real token
arrives, as at the start of a training sequence. That holds because a row's padding comes before
its real tokens (the engine's prompts); any other pattern is refused.

Full-attention layers gate their context with ``sigmoid(gate)`` (megatron's
``attention_output_gate``) before the output projection: :func:`apply_output_gate`.
"""

from __future__ import annotations

import torch

from verl_megatron.models.families.qwen3_next_layers import GatedDeltaNet

__all__ = ["apply_output_gate", "gdn_empty_states", "gdn_layer_step", "is_gdn_layer"]


def is_gdn_layer(layer: torch.nn.Module) -> bool:
    return isinstance(layer.self_attention, GatedDeltaNet)


def gdn_empty_states(
    layer: torch.nn.Module, batch: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero (conv state [B, C/tp, K-1], recurrent state [B, nv/tp, dk, dv]) of one DeltaNet layer."""
    attn = layer.self_attention
    weight = attn.conv1d.weight
    conv = torch.zeros(batch, weight.shape[0], weight.shape[-1] - 1, dtype=dtype, device=weight.device)
    state = torch.zeros(batch, attn.nv, attn.dk, attn.dv, dtype=torch.float32, device=weight.device)
    return conv, state


def gdn_layer_step(
    layer: torch.nn.Module, hidden: torch.Tensor, conv: torch.Tensor, state: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """One decoder step of a DeltaNet layer: hidden [s, B, H] -> [s, B, H]; the states advance in place.
    ``valid`` [B, s]: which new tokens are real (a prefill's left padding is not)."""
    if valid.shape[1] > 1 and bool((valid[:, 1:] < valid[:, :-1]).any()):
        raise NotImplementedError(
            "native rollout of gated DeltaNet layers: a prompt has padding after real tokens "
            "(only left padding keeps the recurrent state exact)"
        )
    out, new_conv, new_state = layer.self_attention.run(
        layer.input_layernorm(hidden), conv, state, None if bool(valid.all()) else valid
    )
    conv.copy_(new_conv)
    state.copy_(new_state)
    hidden = hidden + out
    out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
    return hidden + out if bias is None else hidden + out + bias


def apply_output_gate(context: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """context [s, B, heads * D] scaled by sigmoid(gate [s, B, heads, D]) in float32, as megatron's
    ``Attention._apply_output_gate``."""
    return (context * torch.sigmoid(gate.float()).reshape(context.shape)).to(context.dtype)
