"""The Qwen2.5-VL vision tower as a plain torch module (replicated on every tp rank: see
``qwen2_vl.py`` for why).

Input: ``pixel_values`` [P, C * temporal_patch * patch * patch] (the image processor's patches of
every image, each image's patches in groups of ``m x m`` that the merger fuses; ``m`` =
``spatial_merge_size``) and ``image_grid_thw`` [n, 3] (t, h, w patches per image). Output: one
feature [P / m^2, out_hidden_size] per language-model image token, in the images' order.

Inside, patches are reordered window by window (each window: ``window_tokens x window_tokens``
merged tokens of one frame, the last row/column of windows cut short at the image's edge), so
that a window attention is attention inside contiguous segments; full-attention blocks attend
within each frame of each image (also contiguous in that order). The 2-D rotary embedding rotates
the first half of each head's frequencies with the patch's row and the second half with its
column. Parameter names are those of HF's ``visual`` module, so weights are copied by name.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from verl_megatron.models.families.qwen2_vl import VisionArchitecture

__all__ = [
    "MatmulSite",
    "VisionAttention",
    "VisionBlock",
    "VisionLinear",
    "VisionTower",
    "frame_edges",
    "patch_rows_cols",
    "window_order",
]

_NORM_EPS = 1e-6


class MatmulSite:
    """A tower module whose products ``x @ W.T (+ b)`` go through ``self.matmul`` (``F.linear``'s
    arguments). Bitwise parity hands it the batch-invariant one (``models/batch_invariant.py``), so
    a patch's features do not depend on which other images share the tower call."""

    matmul = staticmethod(F.linear)

    def use_matmul(self, matmul) -> None:
        self.matmul = matmul


class VisionLinear(MatmulSite, torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters and names) through :class:`MatmulSite`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class _RMSNorm(torch.nn.Module):
    """RMS norm computed in float32, scaled in the input dtype (as Qwen2's)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + _NORM_EPS)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(torch.nn.Module):
    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = arch.num_heads
        self.qkv = VisionLinear(arch.hidden_size, 3 * arch.hidden_size, dtype=dtype)
        self.proj = VisionLinear(arch.hidden_size, arch.hidden_size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """x [N, hidden]; cos/sin [N, head_dim] (float32); ``bounds`` the segment edges 0..N."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)  # each [N, heads, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, d]
        parts = [
            F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
            for a, b in itertools.pairwise(bounds)
        ]
        return self.proj(torch.cat(parts, dim=1).transpose(0, 1).reshape(x.shape[0], -1))


class _MLP(torch.nn.Module):
    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = VisionLinear(arch.hidden_size, arch.intermediate_size, dtype=dtype)
        self.up_proj = VisionLinear(arch.hidden_size, arch.intermediate_size, dtype=dtype)
        self.down_proj = VisionLinear(arch.intermediate_size, arch.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(torch.nn.Module):
    """Pre-norm attention + MLP block; ``norm`` / ``mlp`` build the family's norm and MLP."""

    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype, norm=_RMSNorm, mlp=_MLP) -> None:
        super().__init__()
        self.norm1 = norm(arch.hidden_size, dtype)
        self.norm2 = norm(arch.hidden_size, dtype)
        self.attn = VisionAttention(arch, dtype)
        self.mlp = mlp(arch, dtype)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(MatmulSite, torch.nn.Module):
    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (arch.temporal_patch_size, arch.patch_size, arch.patch_size)
        self.proj = torch.nn.Conv3d(
            arch.in_channels, arch.hidden_size, kernel, stride=kernel, bias=False, dtype=dtype
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # A convolution whose kernel is the whole patch is a linear map of the flattened patch.
        return self.matmul(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class _Merger(torch.nn.Module):
    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        width = arch.hidden_size * arch.merge_unit
        self.ln_q = _RMSNorm(arch.hidden_size, dtype)
        self.mlp = torch.nn.Sequential(
            VisionLinear(width, width, dtype=dtype),
            torch.nn.GELU(),
            VisionLinear(width, arch.out_hidden_size, dtype=dtype),
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def window_order(grid_thw: torch.Tensor, arch: VisionArchitecture) -> tuple[torch.Tensor, list[int]]:
    """(order [P / m^2] of the merged tokens, window edges in patches) for ``grid_thw`` [n, 3]."""
    side, merge = arch.window_tokens, arch.spatial_merge_size
    order: list[torch.Tensor] = []
    edges, offset = [0], 0
    for t, h, w in grid_thw.tolist():
        index = torch.arange(t * (h // merge) * (w // merge)).view(t, h // merge, w // merge) + offset
        for frame in index:
            for top in range(0, frame.shape[0], side):
                for left in range(0, frame.shape[1], side):
                    window = frame[top : top + side, left : left + side].flatten()
                    order.append(window)
                    edges.append(edges[-1] + window.numel() * arch.merge_unit)
        offset += index.numel()
    return torch.cat(order), edges


def frame_edges(grid_thw: torch.Tensor) -> list[int]:
    """Edges (in patches) of every frame of every image: the full-attention segments."""
    edges = [0]
    for t, h, w in grid_thw.tolist():
        edges.extend(edges[-1] + (i + 1) * h * w for i in range(t))
    return edges


def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of each patch, patches grouped m x m per merged token."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class VisionTower(torch.nn.Module):
    """Patch embedding, ``depth`` blocks and the patch merger of a Qwen2.5-VL vision tower."""

    def __init__(self, arch: VisionArchitecture, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.patch_embed = _PatchEmbed(arch, dtype)
        self.blocks = torch.nn.ModuleList(VisionBlock(arch, dtype) for _ in range(arch.depth))
        self.merger = _Merger(arch, dtype)
        quarter = arch.head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / arch.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter),
            persistent=False,
        )

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """[P / m^2, out_hidden_size] features of the images, in order (see the module docstring)."""
        unit = self.arch.merge_unit
        order, window_edges = window_order(image_grid_thw, self.arch)
        frames = frame_edges(image_grid_thw)
        x = self.patch_embed(pixel_values)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        rows_cols = patch_rows_cols(image_grid_thw, self.arch.spatial_merge_size).to(x.device)
        rows_cols = rows_cols.view(-1, unit, 2)[order].flatten(0, 1)
        angles = (rows_cols.unsqueeze(-1).float() * self.inv_freq).flatten(1)  # [P, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            bounds = frames if i in self.arch.fullatt_block_indexes else window_edges
            x = block(x, cos, sin, bounds)
        return self.merger(x)[torch.argsort(order)]
