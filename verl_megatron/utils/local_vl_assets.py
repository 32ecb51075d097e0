"""A tiny Qwen2.5-VL checkpoint with its tokenizer and image processor, built on the spot.

Nothing is fetched: the tokenizer is ``local_assets.build_bpe_tokenizer``'s byte-level BPE plus
Qwen2-VL's vision markers, the image processor is transformers' Qwen2-VL one with a small pixel
budget, and the model a random ``Qwen2_5_VLForConditionalGeneration`` (vision tower: 2 blocks,
the first with window attention, the second full; language model: 2 Qwen2 layers with 3-D rope).
No video processor is saved: transformers' needs torchvision (see ``data.multimodal``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from verl_megatron.utils.local_assets import build_bpe_tokenizer

__all__ = [
    "VISION_TOKENS", "VL_CHAT_TEMPLATE", "build_tiny_qwen2_5_vl", "build_tiny_qwen3_vl", "build_vl_tokenizer", "shape_image",
]  # fmt: skip

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def shape_image(size: tuple[int, int], colour: str, shape: str = "square", background=(245, 245, 245)) -> Any:
    """A PIL RGB image of ``size`` (width, height): one ``shape`` (square or circle) of ``colour``
    (a :data:`COLOURS` name) covering the middle half of each side, on a plain background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, background)
    draw = ImageDraw.Draw(image)
    width, height = size
    box = (width // 4, height // 4, 3 * width // 4, 3 * height // 4)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return image


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML whose message content may be a list of {"type": "text"|"image"} parts (Qwen2-VL's form).
VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Vision tower: hidden 32, 2 heads (head 16), window 56 pixels = 2 x 2 merged tokens; language
# model: hidden 64, 4 heads in 2 kv groups (head 16: 8 rotary frequencies as mrope [2, 3, 3]).
TINY_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
    fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
)  # fmt: skip
TINY_TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)  # fmt: skip


def build_vl_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 320) -> Any:
    """``build_bpe_tokenizer`` plus the vision markers (special, ids after the BPE's), with a chat
    template that renders image parts; saved to ``out_dir`` and returned as reloaded."""
    from transformers import AutoTokenizer

    tokenizer = build_bpe_tokenizer(out_dir, vocab_size=vocab_size, chat_template=VL_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(os.fspath(out_dir), local_files_only=True)


def _image_processor(max_pixels: int) -> Any:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels)


def build_tiny_qwen2_5_vl(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    max_pixels: int = 28 * 28 * 64,
    vision: dict[str, Any] | None = None,
    text: dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> Any:
    """A random Qwen2.5-VL (float32, eval mode) with tokenizer and image processor in ``out_dir``.

    Weights are drawn with std 0.1, norm weights and biases around 1 / 0 (transformers starts
    them at exactly 1 / 0, which would hide a swapped norm or an unloaded bias). ``vision`` / ``text`` override the tiny config's fields.
    ``tokenizer``: one with the vision markers (e.g. ``vl_word_tokenizer``'s), saved beside the model
    instead of ``build_vl_tokenizer``'s BPE.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    os.makedirs(out_dir, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_vl_tokenizer(out_dir)
    else:
        tokenizer.save_pretrained(out_dir)
    _image_processor(max_pixels).save_pretrained(out_dir)
    ids = tokenizer.convert_tokens_to_ids
    text_config = {
        **TINY_TEXT, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, **(text or {}),
    }  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={**TINY_VISION, **(vision or {})},
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(torch.randn(param.shape) * 0.2)
                else:  # std 0.1: image features large enough to move the logits visibly
                    param.copy_(torch.randn(param.shape) * 0.1)
    model.eval()
    model.save_pretrained(out_dir)
    return model


# Qwen3-VL: vision hidden 32, 2 heads, patches of 16 pixels, a 4 x 4 learned position grid
# (interpolated to each image), 3 blocks whose first two feed DeepStack; language model: 4
# Qwen3 layers (q/k norms), head 32 (16 frequencies: interleaved mrope [6, 5, 5]).
TINY_QWEN3_VISION = dict(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
)  # fmt: skip
TINY_QWEN3_TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
)  # fmt: skip


def build_tiny_qwen3_vl(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    max_pixels: int = 32 * 32 * 64,
    text: dict[str, Any] | None = None,
) -> Any:
    """A random Qwen3-VL (dense text model; float32, eval mode) with tokenizer and image processor
    (patches of 16 pixels) in ``out_dir``. Every weight is redrawn (matrices std 0.1, vectors
    around their initial value +- 0.2): DeepStack features then move the logits visibly."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_vl_tokenizer(out_dir)
    Qwen2VLImageProcessorPil(
        patch_size=16, min_pixels=32 * 32, max_pixels=max_pixels, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(out_dir)
    marker = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={**TINY_QWEN3_TEXT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id, **(text or {})},
        vision_config=TINY_QWEN3_VISION,
        image_token_id=marker("<|image_pad|>"), video_token_id=marker("<|video_pad|>"),
        vision_start_token_id=marker("<|vision_start|>"), vision_end_token_id=marker("<|vision_end|>"),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for tensor in model.parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            tensor.copy_(tensor + noise * 0.2 if tensor.dim() == 1 else noise * 0.1)
    model.save_pretrained(out_dir)
    return model
