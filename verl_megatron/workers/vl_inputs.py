"""Image rows through the actor and the reference: per-row images and 3-D positions in micro-batches.

A vision-language batch (verl's layout) carries, besides the text tensors:

- ``non_tensor_batch["multi_modal_inputs"]``: one entry per row, a dict with the row's
  ``pixel_values`` [P_i, C*t*p*p] and ``image_grid_thw`` [n_i, 3] (the image processor's
  outputs), or None / ``{}`` for a row without images;
- ``batch["position_ids"]`` [B, 3, T]: the 3-D rotary ids of every column (``utils/mrope.py``,
  0 at padding), aligned with ``input_ids``; or verl's newer [B, 4, T], a text-position row
  followed by those three (the first row is then not used).

:func:`row_images` reads them into :class:`RowImages`, which the worker's batch dict carries under
:data:`ROW_IMAGES` as an explicit entry; indexing it with row indices (mini-batches, dp shares,
micro-batches) selects those rows' images, so a micro-batch split always takes its rows' images
along. :func:`attach_images` puts a micro-batch's images into its ``ModelInputs``: pixel values
and grids of its rows concatenated in row order (the order the model meets their image tokens
when it reads the laid-out ``input_ids`` row by row) and the [3, b, S] positions moved with the
tokens: padded rows and packed rows both keep each row's valid tokens in order, so the laid-out
non-padding columns, read row-major, are the valid columns of the batch, read row-major.

Token budgets (``use_dynamic_bsz``) count a row's ``attention_mask`` tokens, which include its
image tokens (one per merged patch); the vision tower's own patches (``merge^2`` per image
token) are not counted separately. Packed rows on megatron's local attention (block-causal
mask, 3-D ids laid out per token) equal padded rows (``tests/test_vl_packing.py``, float64
reference). Not supported yet (named errors): packed THD sequences (Transformer Engine's fused
rotary, ``apply_rope_fusion``, turns each sequence by its offset from the sequence start, not by
the 3-D ids; megatron's unfused THD rotary would take one frequency row per packed token, untested
without Transformer Engine) and context parallelism.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from verl_megatron.errors import ParallelConfigError
from verl_megatron.workers.model_inputs import ModelInputs

__all__ = [
    "IMAGES_KEY",
    "ROW_IMAGES",
    "RowImages",
    "attach_images",
    "model_kwargs",
    "row_images",
    "with_response_positions",
]

IMAGES_KEY = "multi_modal_inputs"
"""verl's non-tensor column of per-row image-processor outputs."""
ROW_IMAGES = "row_images"
"""The worker batch dict's entry holding :class:`RowImages`."""


@dataclass(frozen=True)
class RowImages:
    """Per-row images of a batch of B rows (None where a row has none) and their [B, 3, T] positions."""

    pixel_values: tuple[torch.Tensor | None, ...]
    image_grid_thw: tuple[torch.Tensor | None, ...]
    position_ids: torch.Tensor

    def __getitem__(self, rows: torch.Tensor) -> RowImages:
        """The rows ``rows`` (a 1-D index tensor into this batch), in that order."""
        index = [int(i) for i in rows.reshape(-1).tolist()]
        return RowImages(
            pixel_values=tuple(self.pixel_values[i] for i in index),
            image_grid_thw=tuple(self.image_grid_thw[i] for i in index),
            position_ids=self.position_ids[rows],
        )

    def concatenated(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(pixel values, grids) of every row's images in row order; (None, None) without images."""
        pixels = [p for p in self.pixel_values if p is not None]
        grids = [g for g in self.image_grid_thw if g is not None]
        if not grids:
            return None, None
        return torch.cat(pixels), torch.cat(grids).long()


def _entry(value, row: int, where: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if value is None or (isinstance(value, dict) and not value):
        return None, None
    if not isinstance(value, dict) or "pixel_values" not in value or "image_grid_thw" not in value:
        raise ValueError(
            f"{where}: non_tensor_batch['{IMAGES_KEY}'] row {row} must be a dict with 'pixel_values' and "
            f"'image_grid_thw' (or None for a row without images), got {type(value).__name__}"
        )
    pixels, grids = torch.as_tensor(value["pixel_values"]), torch.as_tensor(value["image_grid_thw"]).long()
    if grids.dim() != 2 or grids.shape[-1] != 3 or int(grids.prod(-1).sum()) != pixels.shape[0]:
        raise ValueError(
            f"{where}: non_tensor_batch['{IMAGES_KEY}'] row {row}: image_grid_thw {tuple(grids.shape)} "
            f"(t*h*w summing to {int(grids.prod(-1).sum()) if grids.dim() == 2 else '?'}) does not "
            f"describe pixel_values {tuple(pixels.shape)} (one row per patch)"
        )
    return pixels, grids


def row_images(data, where: str) -> dict[str, RowImages]:
    """``{ROW_IMAGES: RowImages}`` of a DataProto whose rows carry images, else ``{}``; ValueError /
    KeyError naming the row or key when the images or their positions are malformed."""
    column = (data.non_tensor_batch or {}).get(IMAGES_KEY)
    if column is None:
        return {}
    entries = [_entry(value, row, where) for row, value in enumerate(column)]
    if all(grids is None for _, grids in entries):
        return {}
    ids = data.batch["input_ids"]
    positions = data.batch["position_ids"] if "position_ids" in data.batch.keys() else None  # noqa: SIM118
    if (
        positions is None
        or positions.dim() != 3
        or positions.shape[1] not in (3, 4)
        or positions.shape[::2] != ids.shape
    ):
        got = "missing" if positions is None else f"of shape {tuple(positions.shape)}"
        raise KeyError(
            f"{where}: rows with images need batch['position_ids'] [B, 3, T] = {[ids.shape[0], 3, ids.shape[1]]} "
            f"(3-D rotary ids, utils/mrope.mrope_position_ids_batch; or verl's [B, 4, T]); it is {got}"
        )
    return {
        ROW_IMAGES: RowImages(
            pixel_values=tuple(p for p, _ in entries),
            image_grid_thw=tuple(g for _, g in entries),
            position_ids=positions[:, -3:].cpu().long(),  # [B, 4, T]: the text row first
        )
    }


def attach_images(
    inputs: ModelInputs,
    images: RowImages,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    thd: bool,
    cp_size: int,
    response_length: int = 0,
) -> ModelInputs:
    """``inputs`` of a micro-batch whose rows (``input_ids``/``attention_mask`` [r, T], batch layout)
    carry ``images``: the rows' pixel values and grids, and [3, b, S] positions laid out like the tokens;
    the last ``response_length`` columns are responses (``prompt_mask`` False there)."""
    if thd or cp_size > 1:
        raise ParallelConfigError(
            "image rows cannot be packed as THD sequences or split over context-parallel ranks yet "
            "(Transformer Engine's fused rotary turns each packed sequence by its offset, not by the rows' "
            "3-D ids; its attention takes no padded rows): use megatron's local attention "
            "(model.use_te=false; packed rows get a block-causal mask) and parallel.cp=1 "
            f"(got thd={thd}, cp={cp_size})"
        )
    keep = (
        ~inputs.padding if inputs.padding is not None else torch.ones_like(inputs.input_ids, dtype=torch.bool)
    )
    valid = attention_mask.bool()
    if inputs.shared_prefix is not None or not torch.equal(inputs.input_ids[keep], input_ids[valid]):
        raise ValueError(
            "attach_images: the layout does not keep each row's tokens in order (shared-prompt rows?); "
            "3-D positions and image features follow the row-major token order"
        )
    laid = torch.zeros((3, *inputs.input_ids.shape), dtype=torch.long)
    laid[:, keep] = images.position_ids.transpose(0, 1)[:, valid]
    prompt = torch.zeros(inputs.input_ids.shape, dtype=torch.bool)
    prompt[keep] = (torch.arange(valid.shape[1]) < valid.shape[1] - response_length).expand_as(valid)[valid]
    pixels, grids = images.concatenated()
    return dataclasses.replace(
        inputs, position_ids=laid, pixel_values=pixels, image_grid_thw=grids, prompt_mask=prompt
    )


def model_kwargs(inputs: ModelInputs, device: torch.device) -> dict[str, torch.Tensor]:
    """The model call's image arguments of a micro-batch (``{}`` without images)."""
    if inputs.pixel_values is None:
        return {}
    out = {"pixel_values": inputs.pixel_values.to(device), "image_grid_thw": inputs.image_grid_thw}
    if inputs.prompt_mask is not None:
        out["prompt_mask"] = inputs.prompt_mask.to(device)
    return out


def with_response_positions(prompt_positions: torch.Tensor, response_length: int) -> torch.Tensor:
    """[B, 3, Tp + Tr] ids of prompts [B, 3, Tp] (left-padded, 0 at padding) followed by Tr response
    columns: text, so all three ids of response token k are the row's largest prompt id + 1 + k
    (what :func:`utils.mrope.mrope_position_ids` gives the whole sequence: after an image or a text
    run the running position is the largest id so far + 1). Padding response columns get ids too;
    the attention mask hides them."""
    start = prompt_positions.amax(dim=(1, 2)) + 1
    steps = start[:, None] + torch.arange(response_length, device=prompt_positions.device)[None, :]
    return torch.cat([prompt_positions, steps.unsqueeze(1).expand(-1, 3, -1)], dim=-1)
