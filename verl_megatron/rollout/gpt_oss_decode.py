"""GPT-OSS in the native decoder: attention sinks and per-layer sliding windows over the KV cache.

The cache is the plain grouped-query one (``decode.py``); what changes is the attention over it.
Each step builds one visibility mask per window size from the step's additive mask: a key is
visible to a query of a sliding-window layer when it is also among the ``window`` latest tokens
of the query's own sequence, counted in *positions* (a cache column's position is the number of
real tokens before it in its row, so left padding and holes in the cache do not shift windows).
The arithmetic (sink column in the softmax, then dropped) is ``models.families.gpt_oss``'s
:func:`~verl_megatron.models.families.gpt_oss.attend_with_sinks`, as in training.
"""

from __future__ import annotations

import torch

from verl_megatron.models.families.gpt_oss import attend_with_sinks, window_allowed
from verl_megatron.models.families.gpt_oss_layers import SinkWindowAttention

__all__ = ["SinkWindows"]


class SinkWindows:
    """The sliding-window sizes of a GPT-OSS model's layers (None: full attention)."""

    def __init__(self, windows: set[int | None]) -> None:
        self.windows = windows

    @staticmethod
    def of(chunks: list[torch.nn.Module]) -> SinkWindows | None:
        """The model's windows when its layers attend with sinks, else None."""
        layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
        cores = [getattr(layer.self_attention, "core_attention", None) for layer in layers]
        if not any(isinstance(core, SinkWindowAttention) for core in cores):
            return None
        return SinkWindows({core.window for core in cores})

    def masks(
        self, mask: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor, start: int
    ) -> dict[int | None, torch.Tensor]:
        """The step's additive mask [B, 1, s, start+s] -> bool visibility per window size."""
        end = mask.shape[-1]
        allowed = mask == 0
        key_pos = key_valid[:, :end].long().cumsum(-1) - 1  # [B, end]
        out: dict[int | None, torch.Tensor] = {}
        for window in self.windows:
            inside = window_allowed(positions[:, None, :, None], key_pos[:, None, None, :], window)
            out[window] = allowed if window is None else allowed & inside
        return out

    @staticmethod
    def store_and_attend(
        attention: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor, value: torch.Tensor, masks: dict, start: int,
    ) -> torch.Tensor:  # fmt: skip
        """Write keys / values [s, B, groups, D] at column ``start``; attend with query [s, B, heads, D]
        over columns < start + s with the layer's sinks and window -> context [s, B, heads * D]."""
        s, batch = query.shape[:2]
        k_cache[:, :, start : start + s] = key.permute(1, 2, 0, 3)
        v_cache[:, :, start : start + s] = value.permute(1, 2, 0, 3)
        core = attention.core_attention
        context = attend_with_sinks(
            query.permute(1, 2, 0, 3), k_cache[:, :, : start + s], v_cache[:, :, : start + s],
            masks[core.window], core.softmax_scale, core.softmax_offset,
        )  # fmt: skip
        return context.permute(2, 0, 1, 3).reshape(s, batch, -1)
