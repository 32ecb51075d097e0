"""megatron's GPTModel with a Qwen3-VL vision tower in front: interleaved 3-D rope and DeepStack.

Called like ``Qwen2VLGPTModel`` (``qwen2_vl_model.py``): ``chunk(input_ids, position_ids,
attention_mask, pixel_values=..., image_grid_thw=..., ...)`` with [3, B, T] (or [B, T]) ids and the
micro-batch's images in the order their tokens appear row by row. Two additions:

- the rotary module is :class:`InterleavedMropeRotary` (megatron-core 0.16.1's multimodal rotary
  has only the sectioned layout): the same ``inv_freq``, each frequency turned by the id
  ``utils/mrope.mrope_frequency_axes(..., interleaved=True)`` gives it;
- DeepStack: the first stage's forward computes the tower's DeepStack features with the image
  features and hands them to :class:`DeepstackInjector` (owned by the model) for the duration of
  the call; the injector's forward hooks on decoder layers 0..K-1 add feature ``k`` to layer
  ``k``'s output at the image tokens. Those layers are on the first stage by construction (the
  layout check in ``__init__``), so the features never travel between pipeline stages; full
  activation recompute (which re-runs layers outside the call) is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from verl_megatron.errors import ModelConfigError
from verl_megatron.models.families import qwen2_vl_model
from verl_megatron.models.families.qwen2_vl import VLArchitecture
from verl_megatron.models.families.qwen2_vl_model import Qwen2VLGPTModel, place_image_features
from verl_megatron.models.families.qwen3_vl import check_deepstack_layout
from verl_megatron.models.families.qwen3_vl_vision import Qwen3VisionTower
from verl_megatron.utils.mrope import mrope_frequency_axes

__all__ = [
    "DeepstackFeatures",
    "DeepstackInjector",
    "InterleavedMropeRotary",
    "Qwen3VLGPTModel",
    "vl_model_class",
]


def vl_model_class(
    vl: VLArchitecture, seed: int, model_cfg: Any, value_head: bool
) -> tuple[type, dict[str, Any]]:
    """The builder's (model class, extra arguments) for Qwen2.5-VL and Qwen3-VL checkpoints."""
    model_class, kwargs = qwen2_vl_model.vl_model_class(vl, seed, model_cfg, value_head)
    return (Qwen3VLGPTModel if vl.deepstack_layers or vl.mrope_interleaved else model_class), kwargs


class InterleavedMropeRotary(torch.nn.Module):
    """Rotary angles [T, B, 1, R] of [3, B, T] ids, frequencies laid out as Qwen3-VL's."""

    def __init__(self, inv_freq: torch.Tensor, section: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.detach().clone(), persistent=False)
        self.register_buffer("axes", mrope_frequency_axes(section, interleaved=True), persistent=False)

    def forward(
        self, position_ids: torch.Tensor, mrope_section: Any = None, cp_group: Any = None
    ) -> torch.Tensor:
        """``position_ids`` [3, B, T]; ``mrope_section``/``cp_group``: megatron's call (cp > 1 is refused for VL)."""
        angles = position_ids.to(self.inv_freq.device).float().unsqueeze(-1) * self.inv_freq  # [3, B, T, R/2]
        picked = angles.gather(0, self.axes.expand(1, *angles.shape[1:3], -1)).squeeze(0)  # [B, T, R/2]
        return torch.cat((picked, picked), dim=-1).transpose(0, 1).unsqueeze(2).contiguous()


@dataclass
class DeepstackFeatures:
    """What DeepStack adds in one forward: ``per_layer[k]`` [N, H] at the ``image_mask`` [B, T]
    tokens (row-major) after decoder layer ``k``."""

    image_mask: torch.Tensor
    per_layer: list[torch.Tensor]

    def add(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, B, H] plus layer ``layer``'s features at the image tokens."""
        by_row = hidden.transpose(0, 1)
        extra = torch.zeros_like(by_row).masked_scatter(
            self.image_mask.unsqueeze(-1), self.per_layer[layer].to(hidden.dtype)
        )
        return (by_row + extra).transpose(0, 1).contiguous()


class DeepstackInjector:
    """Forward hooks on decoder layers 0..K-1 of a first-stage chunk that add the features of the
    current call (:meth:`inject`); a hooked layer run outside a call is an error."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self._current: DeepstackFeatures | None = None
        self._inside = False
        for k, layer in enumerate(layers):
            layer.register_forward_hook(self._hook(k))

    @contextlib.contextmanager
    def inject(self, features: DeepstackFeatures | None) -> Iterator[None]:
        self._current, self._inside = features, True
        try:
            yield
        finally:
            self._current, self._inside = None, False

    def _hook(self, k: int):
        def add_features(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if not self._inside:
                raise RuntimeError(
                    f"DeepStack layer {k} ran outside Qwen3VLGPTModel.forward (activation recompute?)"
                )
            if self._current is None:
                return output
            if isinstance(output, tuple):
                return (self._current.add(k, output[0]), *output[1:])
            return self._current.add(k, output)

        return add_features


class Qwen3VLGPTModel(Qwen2VLGPTModel):
    """Qwen2VLGPTModel with Qwen3-VL's tower, interleaved 3-D rope and DeepStack."""

    tower_class = Qwen3VisionTower

    def __init__(self, *args: Any, vl: VLArchitecture, **kwargs: Any) -> None:
        super().__init__(*args, vl=vl, **kwargs)
        from megatron.core.transformer.transformer_block import get_num_layers_to_build

        config = self.config
        vpp = config.virtual_pipeline_model_parallel_size or 1
        first = get_num_layers_to_build(config, vp_stage=0 if vpp > 1 else None, pp_rank=0)
        check_deepstack_layout(vl.deepstack_layers, first, pp=config.pipeline_model_parallel_size, vpp=vpp)
        if vl.deepstack_layers and config.recompute_granularity == "full":
            raise ModelConfigError(
                "qwen3_vl: recompute_granularity=full re-runs the DeepStack layers outside the forward; "
                "use selective recompute or none"
            )
        self.rotary_pos_emb = InterleavedMropeRotary(self.rotary_pos_emb.inv_freq, vl.mrope_section)
        hooked = list(self.decoder.layers[: vl.deepstack_layers]) if self.pre_process else []
        self.deepstack = DeepstackInjector(hooked)

    def embed_images(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        prompt_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DeepstackFeatures]:
        """(embeddings [T, B, H] with the image features placed, the call's DeepStack features);
        ``prompt_mask`` [B, T]: only image-token ids inside it are images (a response may sample one)."""
        image_ids = input_ids if prompt_mask is None else input_ids.masked_fill(~prompt_mask.bool(), -1)
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        merged, per_layer = self.vision(pixel_values.to(embeddings.device), image_grid_thw)
        placed = place_image_features(embeddings, image_ids, merged, self.vl.image_token_id)
        return placed, DeepstackFeatures(image_ids == self.vl.image_token_id, per_layer)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any):
        """``Qwen2VLGPTModel.forward``: GPTModel's arguments plus ``pixel_values``, ``image_grid_thw``
        and ``prompt_mask`` by keyword; DeepStack features live for this call only."""
        images = [kwargs.pop(key, None) for key in ("pixel_values", "image_grid_thw", "prompt_mask")]
        features = None
        if not args:  # GPTModel takes attention_mask positionally, without a default
            kwargs.setdefault("attention_mask", None)
        if (
            self.pre_process
            and images[0] is not None
            and kwargs.get("decoder_input") is None
            and len(args) < 2
        ):
            kwargs["decoder_input"], features = self.embed_images(input_ids, *images)
        if position_ids is not None and position_ids.dim() == 2:  # text: the three ids equal
            position_ids = position_ids.expand(3, *position_ids.shape)
        with self.deepstack.inject(features):
            return GPTModel.forward(self, input_ids, position_ids, *args, **kwargs)
