"""3-D rotary positions of Qwen2-VL / Qwen2.5-VL sequences (multimodal rope, "mrope").

Every token gets three position ids (temporal, height, width). A text token has the same id in all
three: one more than the largest id of anything before it. The tokens of one image (its
``image_grid_thw`` = (t, h, w) patches, merged ``m x m`` into ``t * h/m * w/m`` tokens, laid out
row-major over (t, h/m, w/m)) start at the running position ``p``: temporal ``p + t_i``, height
``p + h_i``, width ``p + w_i``; the running position then moves on by ``max(h, w) / m``. This is
what transformers' ``Qwen2_5_VLModel.get_rope_index`` computes for still images.

The language model rotates each section of the rotary frequencies (``mrope_section``, e.g.
[16, 24, 24] of a head's 64 frequencies) with one of the three ids.
"""

from __future__ import annotations

import torch

__all__ = ["image_token_counts", "mrope_frequency_axes", "mrope_position_ids", "mrope_position_ids_batch"]


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """Language-model tokens of each image: ``t * h * w / m^2`` for its grid row (t, h, w)."""
    return [int(t * h * w) // spatial_merge_size**2 for t, h, w in image_grid_thw.tolist()]


def _image_positions(grid: list[int], start: int, merge: int) -> torch.Tensor:
    """[3, t * h/m * w/m] ids of one image whose first token sits at running position ``start``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + start


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """[3, T] position ids of one unpadded sequence ``input_ids`` [T].

    ``image_grid_thw`` [n, 3] lists the sequence's images in order; each run of image tokens must
    hold whole images (their token counts add up to the run's length), else ValueError.
    """
    ids = input_ids.tolist()
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    merge = spatial_merge_size
    pieces: list[torch.Tensor] = []
    position, i, next_image = 0, 0, 0
    while i < len(ids):
        is_image = ids[i] == image_token_id
        j = i
        while j < len(ids) and (ids[j] == image_token_id) == is_image:
            j += 1
        if not is_image:
            pieces.append(torch.arange(position, position + j - i).expand(3, -1))
            position += j - i
        else:
            remaining = j - i
            while remaining > 0:
                if next_image >= len(grids):
                    raise ValueError(
                        f"{remaining} image tokens at position {j - remaining} have no image grid left"
                    )
                grid = grids[next_image]
                next_image += 1
                piece = _image_positions(grid, position, merge)
                pieces.append(piece)
                remaining -= piece.shape[1]
                position += max(grid[1], grid[2]) // merge
            if remaining < 0:
                raise ValueError(f"the image tokens ending at position {j} do not hold whole images")
        i = j
    if next_image != len(grids):
        raise ValueError(
            f"{len(grids)} image grids for a sequence whose image tokens hold {next_image} images"
        )
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1).long()


def mrope_position_ids_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: list[torch.Tensor | None],
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """[3, B, T] ids of padded rows ``input_ids`` [B, T]: each row's tokens where ``attention_mask``
    is 1 numbered as :func:`mrope_position_ids`; padding gets 0 (as transformers)."""
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    for row, grids in enumerate(image_grid_thw):
        keep = attention_mask[row].bool()
        out[:, row, keep] = mrope_position_ids(
            input_ids[row][keep], grids, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size
        )
    return out


def mrope_frequency_axes(section: list[int] | tuple[int, ...], *, interleaved: bool) -> torch.Tensor:
    """[sum(section)] the id (0 temporal, 1 height, 2 width) that turns each rotary frequency.

    Sectioned (Qwen2-VL, Qwen2.5-VL): the first ``section[0]`` frequencies temporal, the next
    ``section[1]`` height, the rest width. Interleaved (Qwen3-VL): frequency ``i`` is height when
    ``i % 3 == 1`` and ``i < 3 * section[1]``, width when ``i % 3 == 2`` and ``i < 3 * section[2]``,
    else temporal (so the low and high frequencies are shared by all three axes).
    """
    if not interleaved:
        return torch.cat([torch.full((n,), axis, dtype=torch.long) for axis, n in enumerate(section)])
    index = torch.arange(sum(section))
    axes = torch.zeros_like(index)
    for axis in (1, 2):
        axes[(index % 3 == axis) & (index < 3 * section[axis])] = axis
    return axes
