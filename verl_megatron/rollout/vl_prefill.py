"""Image + text prompts in the native rollout (Qwen2.5-VL's multimodal rotary ids and vision tower).

A vision-language prompt batch carries ``position_ids`` [B, 3, Tp] (3-D rotary ids,
``utils/mrope.py``) and ``non_tensor_batch["multi_modal_inputs"]`` (per row pixel values and
grids, ``workers/vl_inputs.py``). The native engine handles it in three places:

- rotary angles: the decoder's table holds the angles of positions 0..T_max-1 (megatron's
  ``MultimodalRotaryEmbedding`` frequencies, concatenated twice); a token's angle in rotary dim
  ``d`` is the table's at its id on the axis that ``d``'s mrope section belongs to
  (:func:`mrope_axes`, :func:`mrope_angles`). Generated tokens are text, so their three ids are
  equal and the plain table lookup of one position gives the same angles;
- the prefill: the first stage embeds the prompt tokens and puts the vision tower's features
  in place of the image tokens (:func:`embed_prompt`), once per prompt: the engine prefills the B
  unique prompts and then copies each prompt's cache rows to its n samples;
- the first generated token's position is the row's largest prompt id + 1
  (:func:`last_positions`; ``workers/vl_inputs.with_response_positions`` gives the output batch
  the same ids).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_megatron.models.families.qwen2_vl_model import place_image_features
from verl_megatron.protocol import DataProto
from verl_megatron.utils.mrope import mrope_frequency_axes
from verl_megatron.workers.vl_inputs import ROW_IMAGES, row_images

__all__ = [
    "embed_prompt",
    "last_positions",
    "mrope_angles",
    "mrope_axes",
    "mrope_table",
    "prompt_images",
    "rotary_table",
]


def prompt_images(prompts: DataProto) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pixel values, grids) of every prompt's images in row order, or None for a text-only batch."""
    found = row_images(prompts, "generate_sequences")
    if not found:
        return None
    pixels, grids = found[ROW_IMAGES].concatenated()
    return pixels, grids


def rotary_table(chunk: torch.nn.Module, max_len: int, mla) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the decoder's rotary table of positions 0..max_len-1, the [R] mrope axes or None): the
    chunk's own rotary module's table (MLA: ``mla.freqs``) unless the chunk takes multimodal ids."""
    if getattr(chunk, "position_embedding_type", "rope") != "mrope":
        return (mla.freqs if mla is not None else chunk.rotary_pos_emb(max_len)), None
    table = mrope_table(chunk, max_len)
    return table, mrope_axes(chunk.mrope_section, table.device, interleaved=chunk.vl.mrope_interleaved)


def mrope_table(chunk: torch.nn.Module, max_len: int) -> torch.Tensor:
    """[max_len, R] rotary angles of positions 0..max_len-1 (frequencies concatenated twice)."""
    inv_freq = chunk.rotary_pos_emb.inv_freq.float().cpu()
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1).to(chunk.rotary_pos_emb.inv_freq.device)


def mrope_axes(section: list[int], device: torch.device, *, interleaved: bool = False) -> torch.Tensor:
    """[R] the position axis (0 temporal, 1 height, 2 width) of each rotary dim: the frequencies'
    axes (``utils/mrope.mrope_frequency_axes``; Qwen3-VL interleaved), twice."""
    return mrope_frequency_axes(section, interleaved=interleaved).repeat(2).to(device)


def mrope_angles(table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """[B, s, R] rows of ``table`` [L, R] (cos or sin) for 3-D ids ``positions`` [B, 3, s]."""
    per_axis = table[positions]  # [B, 3, s, R]
    index = axes.view(1, 1, 1, -1).expand(per_axis.shape[0], 1, per_axis.shape[2], -1)
    return per_axis.gather(1, index).squeeze(1)


def embed_prompt(
    chunk: torch.nn.Module, tokens: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, Any]:
    """([s, B, H] embeddings of ``tokens`` [B, s] with the images' features at their image tokens,
    Qwen3-VL's DeepStack features for the prefill's first layers (``deepstack.add(k, hidden)``
    after layer k < ``len(deepstack.per_layer)``) or None)."""
    if chunk.vl.deepstack_layers:
        return chunk.embed_images(tokens, *images)
    embeddings = chunk.embedding(input_ids=tokens, position_ids=None)
    pixels, grids = images
    features = chunk.vision(pixels.to(embeddings.device), grids)
    return place_image_features(embeddings, tokens, features, chunk.vl.image_token_id), None


def last_positions(positions: torch.Tensor) -> torch.Tensor:
    """[B] the position the first generated token follows: the last column's of 1-D ids [B, Tp],
    the largest of 3-D ids [B, 3, Tp]."""
    return positions[:, -1] if positions.dim() == 2 else positions.amax(dim=(1, 2))
