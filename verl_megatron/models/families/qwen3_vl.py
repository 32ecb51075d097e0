"""Qwen3-VL (``qwen3_vl``, dense text model) in this project's terms: Qwen2.5-VL's layout
(``qwen2_vl.py``: a replicated vision tower in front of megatron's GPTModel with 3-D rope) with
three differences.

- **Language model**: a Qwen3 decoder (q/k RMS norms, no biases, its own ``head_dim``) read as a
  transformers ``Qwen3Config``; its weights are saved under ``model.language_model.*`` (Qwen2.5-VL:
  ``model.*``), the tower's under ``model.visual.*``.
- **Interleaved 3-D rope**: rotary frequency ``i`` turns with the height id when
  ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, with the width id when ``i % 3 == 2`` and
  ``i < 3 * mrope_section[2]``, else with the temporal id (``utils/mrope.mrope_frequency_axes``).
  transformers' Qwen3-VL always uses this layout (``mrope_interleaved`` in the config is not read
  there); megatron-core 0.16.1's ``MultimodalRotaryEmbedding`` only has the sectioned one, so the
  model builds its own rotary module (``qwen3_vl_model.InterleavedMropeRotary``).
- **DeepStack**: the vision tower (``qwen3_vl_vision.py``; learned position embeddings
  interpolated to each image's grid, LayerNorm blocks, full attention per image) also returns, for
  each block in ``deepstack_visual_indexes``, that block's output through its own merger; the
  ``k``-th of these is added to the hidden states after language-model layer ``k`` at the image
  tokens. Those layers must live on the first pipeline stage (with the tower): the features then
  never cross a stage boundary. A layout that puts one elsewhere is refused by name
  (:func:`check_deepstack_layout`); with Qwen3-VL's sizes (3 DeepStack layers of 28..64) every
  usual layout keeps them on stage 0.

Images only: the model takes ``pixel_values``/``image_grid_thw``; videos (and their timestamp
tokens) are not read by this project's data path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_megatron.errors import ModelConfigError
from verl_megatron.models.families.qwen2_vl import (
    VisionShape,
    VLArchitecture,
    language_fields,
    read_text_mrope,
    vision_shape_fields,
)

__all__ = [
    "QWEN3_VL_MODEL_TYPE",
    "Qwen3VisionArchitecture",
    "check_deepstack_layout",
    "read_qwen3_vl_architecture",
]

QWEN3_VL_MODEL_TYPE = "qwen3_vl"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class Qwen3VisionArchitecture(VisionShape):
    """Shapes of a Qwen3-VL vision tower (HF ``vision_config``)."""

    num_position_embeddings: int
    """A square grid of learned position embeddings, bilinearly resampled to every image."""
    deepstack_visual_indexes: tuple[int, ...]
    """Blocks whose outputs (through ``deepstack_merger_list[k]``) go to language-model layer ``k``."""
    hidden_act: str

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


def _read_vision(vision_config: Any) -> Qwen3VisionArchitecture:
    arch = Qwen3VisionArchitecture(
        **vision_shape_fields(vision_config, QWEN3_VL_MODEL_TYPE),
        num_position_embeddings=int(vision_config.num_position_embeddings),
        deepstack_visual_indexes=tuple(int(i) for i in vision_config.deepstack_visual_indexes),
        hidden_act=str(vision_config.hidden_act),
    )
    where = "qwen3_vl: vision_config"
    if arch.hidden_act not in _ACTIVATIONS:
        raise ModelConfigError(f"{where}.hidden_act={arch.hidden_act!r}; supported: {list(_ACTIVATIONS)}")
    if arch.grid_side**2 != arch.num_position_embeddings:
        raise ModelConfigError(
            f"{where}.num_position_embeddings={arch.num_position_embeddings} is not a square"
        )
    if any(not 0 <= i < arch.depth for i in arch.deepstack_visual_indexes):
        raise ModelConfigError(
            f"{where}.deepstack_visual_indexes={list(arch.deepstack_visual_indexes)} must be blocks "
            f"0..{arch.depth - 1}"
        )
    return arch


def read_qwen3_vl_architecture(hf_config: Any) -> VLArchitecture | None:
    """The vision-language facts of a ``qwen3_vl`` config (None for any other model type)."""
    if getattr(hf_config, "model_type", None) != QWEN3_VL_MODEL_TYPE:
        return None
    from transformers import Qwen3Config

    text = hf_config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    section, theta = read_text_mrope(text, QWEN3_VL_MODEL_TYPE, head_dim, 5e5)
    if getattr(text, "attention_bias", False):
        raise ModelConfigError("qwen3_vl: text_config.attention_bias=true is not supported (Qwen3 has none)")
    language = Qwen3Config(
        **language_fields(hf_config),
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    vision = _read_vision(hf_config.vision_config)
    if vision.out_hidden_size != text.hidden_size:
        raise ModelConfigError(
            f"qwen3_vl: vision_config.out_hidden_size={vision.out_hidden_size} != text hidden_size {text.hidden_size}"
        )
    return VLArchitecture(
        vision=vision,  # type: ignore[arg-type]  (the model's tower_class reads this type)
        mrope_section=section,
        image_token_id=int(hf_config.image_token_id),
        video_token_id=int(hf_config.video_token_id),
        language_config=language,
        mrope_interleaved=True,
        deepstack_layers=len(vision.deepstack_visual_indexes),
        hf_vision_prefix="model.visual.",
        hf_language_prefix="model.language_model.",
    )


def check_deepstack_layout(deepstack_layers: int, first_chunk_layers: int, *, pp: int, vpp: int) -> None:
    """DeepStack layers 0..K-1 must all be in the first pipeline chunk (the one with the tower):
    ModelConfigError naming the layout otherwise."""
    if deepstack_layers > first_chunk_layers:
        raise ModelConfigError(
            f"qwen3_vl: parallel.pp={pp} (vpp={vpp}) puts {first_chunk_layers} decoder layers on the first "
            f"pipeline stage, but DeepStack adds image features after layers 0..{deepstack_layers - 1}, which "
            "must all be there (beside the vision tower); use fewer stages"
        )
