"""megatron's GPTModel with a Qwen2.5-VL vision tower in front (first pipeline stage only).

How to call a chunk (``GPTModel.forward`` plus two keyword arguments)::

    out = chunk(input_ids, position_ids, attention_mask=None,
                pixel_values=None, image_grid_thw=None, ...)

- ``position_ids``: [3, B, T] multimodal rotary ids (``utils/mrope.py``), needed on every
  pipeline stage (each computes its layers' rotary embedding from them); [B, T] text positions
  are taken as equal temporal, height and width ids (plain 1-D rope, as transformers).
- ``pixel_values`` [P, C*tp*p*p] and ``image_grid_thw`` [n, 3]: the images of the whole
  micro-batch, in the order their tokens appear in ``input_ids`` read row by row. The first stage
  embeds the tokens, runs the vision tower and puts image feature ``i`` in place of the ``i``-th
  image token (``vl.image_token_id``); other stages ignore them. Without them, a text-only forward.

Everything else (outputs, vocabulary padding, pipeline schedule) is ``builder.py``'s GPTModel.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from verl_megatron.models.families.qwen2_vl import VLArchitecture, check_vl_settings
from verl_megatron.models.families.qwen2_vl_vision import VisionTower

__all__ = ["Qwen2VLGPTModel", "place_image_features", "vl_model_class"]


def vl_model_class(
    vl: VLArchitecture, seed: int, model_cfg: Any, value_head: bool
) -> tuple[type, dict[str, Any]]:
    """(model class, its extra constructor arguments) of a vision-language checkpoint, for the
    builder; ``model_cfg`` is the ``ModelConfig`` (``freeze_vision_tower``)."""
    check_vl_settings(vl, sequence_parallel=model_cfg.sequence_parallel, value_head=value_head)
    return Qwen2VLGPTModel, {"vl": vl, "vision_seed": seed, "freeze_vision": model_cfg.freeze_vision_tower}


def place_image_features(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    image_token_id: int,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``embeddings`` [T, B, H] with row-major image token ``i`` of ``input_ids`` [B, T] replaced
    by ``features[i]`` [N, H]; ValueError when the counts differ."""
    mask = input_ids == image_token_id
    if prompt_mask is not None:  # [B, T]: a response token equal to the image token id stays text
        mask &= prompt_mask.bool()
    count = int(mask.sum())
    if count != features.shape[0]:
        raise ValueError(
            f"the micro-batch has {count} image tokens but its images give {features.shape[0]} features"
        )
    by_row = embeddings.transpose(0, 1)
    by_row = by_row.masked_scatter(mask.unsqueeze(-1), features.to(by_row.dtype))
    return by_row.transpose(0, 1).contiguous()


class Qwen2VLGPTModel(GPTModel):
    """GPTModel (``position_embedding_type="mrope"``) whose first stage owns ``vision``."""

    tower_class: type[torch.nn.Module] = VisionTower
    """The vision tower's module (Qwen3-VL's subclass names its own)."""

    def __init__(
        self, *args: Any, vl: VLArchitecture, vision_seed: int, freeze_vision: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.vl = vl
        self.vision = self.tower_class(vl.vision, self.config.params_dtype) if self.pre_process else None
        if self.vision is not None:
            _init_replicated(self.vision, vision_seed, self.config.init_method_std)
            self.vision.to(self.embedding.word_embeddings.weight.device)
            # Frozen: megatron's DDP and optimizer skip parameters without requires_grad.
            self.vision.requires_grad_(not freeze_vision)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input: torch.Tensor | None = None,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if position_ids is not None and position_ids.dim() == 2:  # text only: t = h = w = the position
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if decoder_input is None and self.pre_process and pixel_values is not None:
            embeddings = self.embedding(input_ids=input_ids, position_ids=None)
            features = self.vision(pixel_values.to(embeddings.device), image_grid_thw)
            decoder_input = place_image_features(
                embeddings, input_ids, features, self.vl.image_token_id, prompt_mask
            )
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)


@torch.no_grad()
def _init_replicated(module: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights drawn from ``seed`` (the same on every rank: the tower is replicated), norms
    at 1, biases at 0; every parameter marked not tensor-parallel (megatron then treats it like a
    layer norm: its gradient counted once in the norm, the same on every tp rank)."""
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    generator = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif "norm" in name or "ln_q" in name:
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        set_defaults_if_not_set_tensor_model_parallel_attributes(param)
