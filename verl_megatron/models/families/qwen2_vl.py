"""Qwen2.5-VL (``qwen2_5_vl``) in this project's terms: a vision tower in front of a Qwen2 decoder.

- **Language model**: a Qwen2 decoder (q/k/v biases) whose rotary embedding is 3-D
  ("mrope", ``utils/mrope.py``): megatron's ``GPTModel`` with ``position_embedding_type="mrope"``
  and the checkpoint's ``mrope_section``; its weights have Qwen2's names (``model.layers.*``,
  ``model.embed_tokens``, ``model.norm``, ``lm_head``), so the Qwen2 rules of ``convert.py``
  load them. :func:`read_vl_architecture` reads the text config as a Qwen2 config.
- **Vision tower** (``qwen2_vl_vision.py``): patch embedding (a 3-D convolution over
  temporal_patch x patch x patch pixels), ``depth`` pre-norm blocks with 2-D rotary attention,
  window attention except in ``fullatt_block_indexes``, and the patch merger (m x m patches ->
  one language-model token). Its parameters are named as HF's ``visual.*`` under ``vision.*``
  and are copied whole.

The vision tower is **replicated** on every tensor-parallel rank of the first pipeline stage, not
split: at Qwen2.5-VL's sizes (0.67B parameters at 7B, the same tower for 3B..72B) it is a small
share of the weights and of the compute of a prompt's tokens, it runs once per prompt, and a
replicated copy needs no collectives and gives every tp layout the same numbers bit for bit. Its
gradient is identical on every tp rank (the decoder's first layer all-reduces the gradient of
its input over tp), and megatron treats its parameters like the layer norms'
(not tensor-parallel: counted once in the gradient norm). Splitting it over tp is a later
optimisation for towers that do not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.errors import ModelConfigError

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
# Rollout engines that take image prompts (the three of rollout/config.ENGINE_NAMES).
VL_ROLLOUT_ENGINES = ("native", "vllm", "sglang")
VISION_PREFIX = "vision."
HF_VISION_PREFIX = "visual."

__all__ = [
    "HF_VISION_PREFIX",
    "VISION_PREFIX",
    "VL_MODEL_TYPES",
    "VLArchitecture",
    "VisionArchitecture",
    "VisionShape",
    "check_vl_attention",
    "check_vl_features",
    "check_vl_rollout",
    "check_vl_settings",
    "hf_language_names",
    "hf_vision_name",
    "language_fields",
    "read_text_mrope",
    "read_vl_architecture",
    "vision_shape_fields",
    "vl_transformer_config",
]


@dataclass(frozen=True)
class VisionShape:
    """Shapes every Qwen vision tower has (HF ``vision_config``; Qwen3-VL's: ``qwen3_vl.py``)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    """The language model's hidden size (the merger's output)."""
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass(frozen=True)
class VisionArchitecture(VisionShape):
    """Shapes of a Qwen2.5-VL vision tower (HF ``vision_config``)."""

    window_size: int
    """Window side in pixels: windows of ``window_size / patch_size / spatial_merge_size`` merged tokens."""
    fullatt_block_indexes: tuple[int, ...]
    """Blocks with full attention (over each image); the others attend within windows."""

    @property
    def window_tokens(self) -> int:
        """Merged tokens per window side."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True)
class VLArchitecture:
    """What a vision-language checkpoint adds to its language model."""

    vision: VisionArchitecture
    mrope_section: tuple[int, ...]
    """Rotary frequencies rotated by the temporal, height and width ids (sums to head_dim / 2)."""
    image_token_id: int
    video_token_id: int
    language_config: Any = field(compare=False, repr=False)
    """The text config as a transformers Qwen2Config (what ``read_hf_architecture`` reads)."""
    mrope_interleaved: bool = False
    """Qwen3-VL's layout of the rotary frequencies over the three ids (``families/qwen3_vl.py``)."""
    deepstack_layers: int = 0
    """Qwen3-VL: decoder layers 0..K-1 get DeepStack image features added after them."""
    hf_vision_prefix: str = HF_VISION_PREFIX
    hf_language_prefix: str = "model."
    """Where transformers saves the tower's and the language model's tensors."""


def vision_shape_fields(vision_config: Any, model_type: str) -> dict[str, Any]:
    """:class:`VisionShape`'s fields read from ``vision_config``; ModelConfigError for a head size
    that the 2-D rotary cannot split."""
    rope = dict(getattr(vision_config, "rope_parameters", None) or {})
    names = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size")
    names += ("temporal_patch_size", "spatial_merge_size", "out_hidden_size")
    fields: dict[str, Any] = {name: int(getattr(vision_config, name)) for name in names}
    fields["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    heads, hidden = fields["num_heads"], fields["hidden_size"]
    if hidden % heads or (hidden // heads) % 4:
        raise ModelConfigError(
            f"{model_type}: vision_config hidden_size={hidden} / num_heads={heads} must be "
            "a head size divisible by 4 (2-D rotary: half of it per axis, in pairs)"
        )
    return fields


def _read_vision(vision_config: Any, model_type: str) -> VisionArchitecture:
    act = getattr(vision_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{model_type}: vision_config.hidden_act={act!r}; only silu is supported")
    arch = VisionArchitecture(
        **vision_shape_fields(vision_config, model_type),
        window_size=int(vision_config.window_size),
        fullatt_block_indexes=tuple(int(i) for i in vision_config.fullatt_block_indexes),
    )
    if arch.window_tokens < 1:
        raise ModelConfigError(
            f"{model_type}: vision_config.window_size={arch.window_size} is smaller than one merged token "
            f"({arch.patch_size * arch.spatial_merge_size} pixels)"
        )
    return arch


def read_text_mrope(
    text: Any, model_type: str, head_dim: int, default_theta: float
) -> tuple[tuple[int, ...], float]:
    """(mrope_section, rope_theta) of a VL text config; ModelConfigError for another rope type or a
    section that does not cover the head's ``head_dim / 2`` frequencies."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if (rope.get("rope_type") or "default") != "default":
        raise ModelConfigError(
            f"{model_type}: text_config rope type {rope.get('rope_type')!r}; only mrope is supported"
        )
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) * 2 != head_dim:
        raise ModelConfigError(
            f"{model_type}: rope_parameters.mrope_section={list(section)} must be 3 numbers adding up to "
            f"head_dim / 2 = {head_dim // 2}"
        )
    return section, float(rope.get("rope_theta", default_theta))


def language_fields(hf_config: Any) -> dict[str, Any]:
    """The text-model config fields every Qwen VL text config has (``hf_config.text_config``)."""
    text = hf_config.text_config
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    names += ("num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps")
    fields = {name: getattr(text, name) for name in names}
    fields["initializer_range"] = getattr(text, "initializer_range", 0.02)
    fields["tie_word_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", False))
    return fields


def read_vl_architecture(hf_config: Any) -> VLArchitecture | None:
    """The vision-language facts of ``hf_config`` (None for a text-only model)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type != "qwen2_5_vl":  # qwen3_vl: families/qwen3_vl.py
        return None
    from transformers import Qwen2Config

    text = hf_config.text_config
    section, theta = read_text_mrope(text, model_type, text.hidden_size // text.num_attention_heads, 1e6)
    language = Qwen2Config(
        **language_fields(hf_config),
        attention_dropout=float(getattr(text, "attention_dropout", 0.0) or 0.0),
        use_sliding_window=bool(getattr(text, "use_sliding_window", False)),
        sliding_window=getattr(text, "sliding_window", None),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    return VLArchitecture(
        vision=_read_vision(hf_config.vision_config, model_type),
        mrope_section=section,
        image_token_id=int(hf_config.image_token_id),
        video_token_id=int(hf_config.video_token_id),
        language_config=language,
    )


def vl_transformer_config(vl: VLArchitecture) -> dict[str, Any]:
    """The TransformerConfig fields of the 3-D rotary embedding."""
    return {"mrope_section": list(vl.mrope_section)}


def check_vl_settings(
    vl: VLArchitecture | None, *, sequence_parallel: bool, freeze: bool = False, value_head: bool = False
) -> None:
    """Refuse what the vision-language path does not do (yet): ModelConfigError naming the key."""
    if vl is None:
        if freeze:
            raise ModelConfigError(
                "model.freeze_vision_tower=true but the checkpoint is not a vision-language model "
                f"(supported: {list(VL_MODEL_TYPES)}); set it to false"
            )
        return
    if sequence_parallel:
        raise ModelConfigError(
            "model.sequence_parallel=True is not supported for vision-language models yet (image "
            "features are placed into the full-sequence embeddings); set it to false"
        )
    if value_head:
        raise ModelConfigError("a critic (value head) on a vision-language model is not supported yet")


def check_vl_features(model_type: str, *, lora_rank: int, bitwise_parity: bool, cp: int) -> None:
    """The trainer's start-up check of a vision-language checkpoint (its image rows go through the
    dataset, the native rollout and the actor): ModelConfigError naming what is not supported yet."""
    if model_type not in VL_MODEL_TYPES:
        return
    # Refused even once image rows train: these paths take 1-D positions or are untested with images.
    # rollout.bitwise_parity is supported (the tower's matmuls are batch-invariant: tests/test_vl_parity.py).
    for on, key, why in (
        (cp > 1, f"parallel.cp={cp}", "the 3-D rotary ids and image features are not split over cp ranks"),
        (lora_rank > 0, f"model.lora_rank={lora_rank}", "LoRA adapters are not tested on the vision tower"),
    ):
        if on:
            raise ModelConfigError(
                f"{key} is not supported for {model_type} (vision-language) checkpoints yet ({why}); turn it off"
            )


def check_vl_rollout(model_type: str, rollout_name: str) -> None:
    """Images reach the native engine's prefill (``rollout/vl_prefill.py``) and vLLM / SGLang as
    ``multi_modal_data`` / ``image_data`` (``rollout/external.py``); an engine without an image
    path would generate from the text alone, so it is refused (ModelConfigError) for a VL checkpoint."""
    if model_type in VL_MODEL_TYPES and rollout_name not in VL_ROLLOUT_ENGINES:
        raise ModelConfigError(
            f"rollout.name={rollout_name} does not pass images to its engine; {model_type} "
            f"(vision-language) checkpoints generate with rollout.name in {list(VL_ROLLOUT_ENGINES)}"
        )


def check_vl_attention(model_type: str, uses_te: Callable[[], bool]) -> None:
    """Image rows need megatron's local attention (``workers/vl_inputs.attach_images``): Transformer
    Engine's attention takes no padded rows and its fused rotary turns packed THD sequences by their
    offsets, not by the 3-D ids. Refused at start-up (ModelConfigError) for a VL checkpoint, before
    a rollout is spent; ``uses_te`` (``ModelConfig.resolve_use_te``) is asked for VL checkpoints only."""
    if model_type in VL_MODEL_TYPES and uses_te():
        raise ModelConfigError(
            f"{model_type} (vision-language) checkpoints train with megatron's local attention: set "
            "model.use_te=false (Transformer Engine's attention takes no padded rows and its fused "
            "rotary turns packed sequences by offset, not by the 3-D rotary ids)"
        )


def hf_vision_name(name: str, vl: VLArchitecture) -> str:
    """HF tensor name of megatron vision parameter ``vision.<...>`` (the same suffix under
    ``vl.hf_vision_prefix``)."""
    return vl.hf_vision_prefix + name.removeprefix(VISION_PREFIX)


def hf_language_names(names: tuple[str, ...], vl: VLArchitecture) -> tuple[str, ...]:
    """The language model's HF names (``model.*`` as a text model saves them) under ``vl.hf_language_prefix``."""
    return tuple(
        vl.hf_language_prefix + n.removeprefix("model.") if n.startswith("model.") else n for n in names
    )
