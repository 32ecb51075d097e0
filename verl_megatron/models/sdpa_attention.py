"""Core attention for megatron's local (non-Transformer-Engine) layer spec through PyTorch SDPA.

megatron's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix with
baddbmm, masks it, runs a separate softmax and a second bmm. ``scaled_dot_product_attention``
does the same mathematics in one call with fused kernels on CPU (and flash/memory-efficient
kernels on GPU), which makes full forward passes (log-probs, training) markedly faster without a
GPU. The GPU path with Transformer Engine is unaffected.

Exactly the same inputs and outputs as megatron's class; configurations whose arithmetic SDPA
would not reproduce exactly (attention dropout while training, query-key layer scaling, softmax
offsets, sliding windows, packed sequences) fall back to megatron's implementation.

Two variants reach it explicitly: a model switched to batch-invariant kernels (the rollout's
bitwise parity mode) hands each core attention its fixed-length attention through
:meth:`SDPADotProductAttention.use_fixed_length_attention`; shared-prompt rows
(``models/shared_prefix_attention.py``) arrive with their layout as the call's
``packed_seq_params``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from verl_megatron.models.shared_prefix_attention import SharedPrefixParams, attend

FixedLengthAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor
]
"""Causal self-attention whose reductions do not depend on the batch (``BatchInvariance.self_attention``):
(query [S, b, H, D], key / value [S, b, G, D], mask None or [b|1, 1, S, S] True = hidden, scale)
-> [S, b, H * D]."""


class SDPADotProductAttention(DotProductAttention):
    """megatron ``DotProductAttention`` computed by ``torch.nn.functional.scaled_dot_product_attention``."""

    fixed_length: FixedLengthAttention | None = None
    """The batch-invariant attention this module computes with (None: SDPA / megatron's)."""

    def use_fixed_length_attention(self, attention: FixedLengthAttention | None) -> None:
        """Attend through ``attention`` from now on (the model is switched to batch-invariant
        kernels), or through SDPA again with None."""
        self.fixed_length = attention

    def _sdpa_applies(self, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (
            packed_seq_params is None
            and attention_bias is None
            and self.softmax_offset is None
            and dropout == 0.0
            and not self.config.apply_query_key_layer_scaling
            and self.scale_mask_softmax.window_size is None
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [sq, b, heads, d], key/value [sk, b, groups, d], mask [b|1, 1, sq, sk] (True = hidden)
        -> context [sq, b, heads * d]."""
        if self.fixed_length is not None and packed_seq_params is None and attention_bias is None:
            return self.fixed_length(query, key, value, attention_mask, self.softmax_scale)
        sq, b = query.shape[0], query.shape[1]
        gqa = self.num_attention_heads_per_partition > self.num_query_groups_per_partition
        if isinstance(packed_seq_params, SharedPrefixParams):
            # Rows that share a prompt: prompt and responses are attended apart instead of
            # scoring every pair of the [S, S] mask.
            context = attend(query, key, value, packed_seq_params.layout, self.softmax_scale, gqa)
            return context.reshape(sq, b, self.hidden_size_per_partition)
        if not self._sdpa_applies(attention_bias, packed_seq_params):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        q = query.permute(1, 2, 0, 3)  # [b, heads, sq, d]
        k = key.permute(1, 2, 0, 3)  # [b, groups, sk, d]
        v = value.permute(1, 2, 0, 3)
        # Grouped-query heads share their group's keys / values inside the kernel rather than
        # through repeat_interleave copies (and their summed gradients): the same outputs, and
        # forward + backward 4-6 ms faster per layer at [16, 4 heads / 2 groups, 192, 64] on CPU.
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if attention_mask is None:
            # megatron builds the causal mask itself when none is given (and none for one query).
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal and sq > 1, scale=self.softmax_scale, enable_gqa=gqa
            )
        else:
            allowed = ~attention_mask.bool()
            # A query whose keys are all hidden (a padding position) would give NaN in SDPA where
            # megatron's -10000 fill gives a finite average; letting it see every key keeps it
            # finite. Such positions are padding that no loss or output reads.
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=gqa
            )
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
