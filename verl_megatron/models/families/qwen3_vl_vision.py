"""The Qwen3-VL vision tower as a plain torch module (replicated on every tp rank, as Qwen2.5-VL's:
see ``qwen2_vl.py``), with its DeepStack outputs.

Input: ``pixel_values`` [P, C * temporal_patch * patch * patch] (the image processor's patches,
each image's in groups of ``m x m`` that a merger fuses, ``m`` = ``spatial_merge_size``) and
``image_grid_thw`` [n, 3]. Output: (features [P / m^2, out_hidden_size], DeepStack features: one
[P / m^2, out_hidden_size] per ``deepstack_visual_indexes`` entry), rows in the images' order.

Inside: the patch embedding (a linear map of the flattened patch, with bias) plus a learned
position embedding: the square ``grid_side x grid_side`` table resampled bilinearly (corners
aligned) to the image's ``h x w`` patches; LayerNorm blocks with 2-D rotary attention over each
frame of each image (the first half of each head's frequencies turned by the patch row, the second
by its column); a merger (LayerNorm per patch, then 2 linears over the m x m concatenation) for
the language model's tokens and, after each DeepStack block, that block's own merger (its
LayerNorm over the concatenation). Parameter names are those of HF's ``model.visual``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_megatron.models.families.qwen2_vl_vision import (
    MatmulSite,
    VisionBlock,
    VisionLinear,
    frame_edges,
    patch_rows_cols,
)
from verl_megatron.models.families.qwen3_vl import Qwen3VisionArchitecture

__all__ = ["Qwen3VisionTower", "position_taps"]

_NORM_EPS = 1e-6


class _MLP(torch.nn.Module):
    def __init__(self, arch: Qwen3VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = VisionLinear(arch.hidden_size, arch.intermediate_size, dtype=dtype)
        self.linear_fc2 = VisionLinear(arch.intermediate_size, arch.hidden_size, dtype=dtype)
        self.approximate = "tanh" if arch.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


def _layer_norm(size: int, dtype: torch.dtype) -> torch.nn.Module:
    return torch.nn.LayerNorm(size, eps=_NORM_EPS, dtype=dtype)


class _Merger(torch.nn.Module):
    """m x m patches -> one token; ``after_concat``: the norm runs over the concatenation (DeepStack)."""

    def __init__(self, arch: Qwen3VisionArchitecture, dtype: torch.dtype, after_concat: bool) -> None:
        super().__init__()
        self.width = arch.hidden_size * arch.merge_unit
        self.after_concat = after_concat
        self.norm = torch.nn.LayerNorm(
            self.width if after_concat else arch.hidden_size, eps=_NORM_EPS, dtype=dtype
        )
        self.linear_fc1 = VisionLinear(self.width, self.width, dtype=dtype)
        self.linear_fc2 = VisionLinear(self.width, arch.out_hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (
            self.norm(x.reshape(-1, self.width))
            if self.after_concat
            else self.norm(x).reshape(-1, self.width)
        )
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(MatmulSite, torch.nn.Module):
    def __init__(self, arch: Qwen3VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (arch.temporal_patch_size, arch.patch_size, arch.patch_size)
        self.proj = torch.nn.Conv3d(arch.in_channels, arch.hidden_size, kernel, stride=kernel, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch: a linear map of the flattened patch.
        return self.matmul(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


def position_taps(grid_thw: torch.Tensor, merge: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [P, 4] into the flattened ``side x side`` table, weights [P, 4]): bilinear
    resampling with aligned corners (row ``r`` of ``h`` reads table row ``r (side-1) / (h-1)``),
    patches in the tower's order (m x m groups, frames repeated)."""
    rows_cols = patch_rows_cols(grid_thw, merge).float()  # [P, 2]
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid_thw.tolist()])
    source = rows_cols * (side - 1) / (sizes - 1).clamp(min=1)
    low = source.floor()
    taps = torch.stack((low, low + 1), dim=-1)  # [P, 2 axes, 2 taps]
    weights = (1 - (source.unsqueeze(-1) - taps).abs()).clamp(min=0)
    taps = taps.long().clamp(0, side - 1)
    index = taps[:, 0, :, None] * side + taps[:, 1, None, :]  # [P, 2 row taps, 2 col taps]
    return index.flatten(1), (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


class Qwen3VisionTower(torch.nn.Module):
    """Patch and position embedding, ``depth`` blocks, the merger and the DeepStack mergers."""

    def __init__(self, arch: Qwen3VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.patch_embed = _PatchEmbed(arch, dtype)
        self.pos_embed = torch.nn.Embedding(arch.num_position_embeddings, arch.hidden_size, dtype=dtype)
        self.blocks = torch.nn.ModuleList(
            VisionBlock(arch, dtype, norm=_layer_norm, mlp=_MLP)
            for _ in range(arch.depth)  # type: ignore[arg-type]
        )
        self.merger = _Merger(arch, dtype, after_concat=False)
        self.deepstack_merger_list = torch.nn.ModuleList(
            _Merger(arch, dtype, after_concat=True) for _ in arch.deepstack_visual_indexes
        )
        quarter = arch.head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / arch.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter),
            persistent=False,
        )

    def forward(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(features, DeepStack features), see the module docstring."""
        merge = self.arch.spatial_merge_size
        x = self.patch_embed(pixel_values)
        index, weights = position_taps(image_grid_thw, merge, self.arch.grid_side)
        table = self.pos_embed.weight
        x = x + (table[index.to(x.device)] * weights.to(x.device, table.dtype).unsqueeze(-1)).sum(1).to(
            x.dtype
        )
        rows_cols = patch_rows_cols(image_grid_thw, merge).to(x.device)
        angles = (rows_cols.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [P, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin, bounds = angles.cos(), angles.sin(), frame_edges(image_grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, bounds)
            if i in self.arch.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.arch.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return self.merger(x), deepstack
