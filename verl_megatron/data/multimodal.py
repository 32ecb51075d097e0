"""Image + text prompts in verl's multimodal row format, checked at start-up.

A row is a verl prompt row (``data/dataset.py``) with an ``images`` column (``data.image_key``)::

    {"prompt": [{"role": "user", "content": "<image>What colour is the square?"}],
     "images": [{"bytes": b"\\x89PNG...", "path": None}],
     "data_source": "shapes", "reward_model": {"ground_truth": "red"}}

Each ``<image>`` in the messages' text stands for the next image of the list, in order (message
by message). An image is any of: encoded bytes; a path (absolute, ``file://`` or relative to the
data file's folder); a dict with ``bytes`` (parquet files written by ``datasets`` store images as
``{"bytes", "path"}``), ``image`` or ``path``; or a PIL image.

:func:`check_multimodal_row` raises a named one-line error that names the row for a missing image
file (:class:`ImageFileNotFoundError`), bytes that do not decode (:class:`ImageDecodeError`), an
image above ``max_pixels`` (:class:`ImageTooLargeError`, checked from the header before decoding)
and a placeholder count that differs from the image count (:class:`ImagePlaceholderError`).

:func:`encode_multimodal_prompt` turns messages + images into model inputs as Qwen2-VL's processor
does: the chat template writes ``<|vision_start|><|image_pad|><|vision_end|>`` for each image,
then each ``<|image_pad|>`` is repeated once per language-model token of its image
(``t * h * w / merge^2`` of the image processor's patch grid).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.errors import UserInputError
from verl_megatron.utils.mrope import image_token_counts, mrope_position_ids_batch

__all__ = [
    "IMAGE_PLACEHOLDER",
    "EncodedImageRow",
    "ImageDataError",
    "ImageDecodeError",
    "ImageFileNotFoundError",
    "ImagePlaceholderError",
    "ImageTextProcessor",
    "ImageTooLargeError",
    "MultimodalPrompt",
    "batch_position_ids",
    "check_multimodal_row",
    "collate_multimodal_prompts",
    "encode_image_row",
    "encode_multimodal_prompt",
    "encoded_image",
    "image_inputs",
    "image_processor_for",
    "load_image",
    "load_image_text_processor",
    "multimodal_columns",
]

IMAGE_PLACEHOLDER = "<image>"
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"


class ImageDataError(UserInputError):
    """Images of a multimodal row (or a processor for them) that cannot be used; the message says where."""


class ImageFileNotFoundError(ImageDataError, FileNotFoundError):
    """An image path that does not exist."""


class ImageDecodeError(ImageDataError):
    """Image bytes (or a file) that PIL cannot decode."""


class ImageTooLargeError(ImageDataError):
    """An image with more pixels than ``data.max_image_pixels``."""


class ImagePlaceholderError(ImageDataError):
    """A row whose ``<image>`` placeholders do not match its images one to one."""


def _image_source(entry: Any, where: str) -> tuple[str, Any]:
    """("bytes", b) | ("path", p) | ("pil", image) for one ``images`` entry."""
    from PIL import Image

    if isinstance(entry, Image.Image):
        return "pil", entry
    if isinstance(entry, (bytes, bytearray, memoryview)):
        return "bytes", bytes(entry)
    if isinstance(entry, str):
        return "path", entry
    if isinstance(entry, dict):
        for key in ("bytes", "image", "path"):
            value = entry.get(key)
            if value is not None:
                return _image_source(value, where)
        raise ImageDataError(f"{where}: image dict has none of 'bytes', 'image', 'path' set: {sorted(entry)}")
    raise ImageDataError(
        f"{where}: an image must be bytes, a path, a dict with 'bytes'/'image'/'path' or a PIL image, "
        f"got {type(entry).__name__}"
    )


def _resolve_path(path: str, base_dir: str | None) -> str:
    path = path.removeprefix("file://")
    path = os.path.expanduser(path)
    if not os.path.isabs(path) and base_dir:
        path = os.path.join(base_dir, path)
    return path


def load_image(entry: Any, where: str, *, base_dir: str | None = None, max_pixels: int | None = None) -> Any:
    """The RGB PIL image of one ``images`` entry, fully decoded; named errors say ``where``."""
    from PIL import Image, UnidentifiedImageError

    kind, value = _image_source(entry, where)
    if kind == "pil":
        image, label = value, "PIL image"
    else:
        if kind == "path":
            label = _resolve_path(value, base_dir)
            if not os.path.isfile(label):
                raise ImageFileNotFoundError(f"{where}: image file '{label}' does not exist")
            source: Any = label
        else:
            label, source = f"{len(value)} image bytes", io.BytesIO(value)
        try:
            image = Image.open(source)
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise ImageDecodeError(f"{where}: {label} do not decode as an image ({err})") from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        # Checked from the header, before decoding: a huge image costs nothing to refuse.
        raise ImageTooLargeError(
            f"{where}: image {label} is {width}x{height} = {width * height} pixels, above "
            f"data.max_image_pixels={max_pixels}"
        )
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as err:  # truncated or corrupt data
        raise ImageDecodeError(f"{where}: {label} do not decode as an image ({err})") from None


def count_placeholders(messages: Sequence[dict[str, Any]]) -> int:
    """Number of ``<image>`` placeholders in the messages' text."""
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)


def check_multimodal_row(
    row: dict[str, Any],
    where: str,
    *,
    prompt_key: str = "prompt",
    image_key: str = "images",
    max_pixels: int | None = None,
    base_dir: str | None = None,
) -> list[Any]:
    """Decode and check the images of ``row``; returns them as RGB PIL images (named errors)."""
    entries = row.get(image_key)
    if entries is None:
        entries = []
    if not isinstance(entries, (list, tuple)) and not hasattr(entries, "tolist"):
        raise ImageDataError(
            f"{where}: field '{image_key}' must be a list of images, got {type(entries).__name__}"
        )
    entries = list(entries)
    messages = row.get(prompt_key) or []
    placeholders = count_placeholders(messages)
    if placeholders != len(entries):
        raise ImagePlaceholderError(
            f"{where}: the prompt has {placeholders} '{IMAGE_PLACEHOLDER}' placeholders but field "
            f"'{image_key}' has {len(entries)} images"
        )
    return [
        load_image(entry, f"{where}: {image_key}[{i}]", base_dir=base_dir, max_pixels=max_pixels)
        for i, entry in enumerate(entries)
    ]


def content_parts(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose text is cut at each ``<image>`` into [{"type": "text"}, {"type": "image"}, ...]
    parts, the form of multimodal chat templates; messages without a placeholder stay as they are."""
    out = []
    for message in messages:
        text = str(message["content"])
        if IMAGE_PLACEHOLDER not in text:
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    return out


@dataclass
class ImageTextProcessor:
    """The two halves of a vision-language processor: a tokenizer and an image processor.

    transformers' ``AutoProcessor`` of Qwen2-VL models also builds a video processor, which needs
    torchvision; these two are all an image + text prompt needs, and they load without it.
    """

    tokenizer: Any
    image_processor: Any
    chat_template: str | None = None

    @property
    def image_token(self) -> str:
        return getattr(self.tokenizer, "image_token", None) or DEFAULT_IMAGE_TOKEN

    @property
    def image_token_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)


def _folder_chat_template(path: str) -> str | None:
    """A processor's own chat template (``chat_template.jinja`` / ``chat_template.json``), if any."""
    jinja, as_json = os.path.join(path, "chat_template.jinja"), os.path.join(path, "chat_template.json")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    if os.path.isfile(as_json):
        with open(as_json, encoding="utf-8") as f:
            return json.load(f).get("chat_template")
    return None


def load_image_text_processor(path: str | os.PathLike, processor: Any = None) -> ImageTextProcessor:
    """The tokenizer and image processor of a checkpoint folder (or of ``processor``, an
    ``hf_processor`` result); ImageDataError naming the folder when it has no image processor."""
    from verl_megatron.utils.tokenizer import hf_tokenizer

    path = os.fspath(path)
    if processor is not None and getattr(processor, "image_processor", None) is not None:
        return ImageTextProcessor(processor.tokenizer, processor.image_processor, processor.chat_template)
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        raise ImageDataError(
            f"'{path}' has no preprocessor_config.json: rows with images need a vision-language "
            "checkpoint's image processor"
        )
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    return ImageTextProcessor(hf_tokenizer(path), image_processor, _folder_chat_template(path))


@dataclass
class MultimodalPrompt:
    """One prompt's model inputs."""

    input_ids: list[int]
    """[T] token ids, each image's placeholder repeated once per image token."""
    pixel_values: torch.Tensor
    """[P, C * temporal_patch * patch * patch] patches of every image, in order."""
    image_grid_thw: torch.Tensor
    """[n_images, 3] (t, h, w) patch grid of each image."""


def encode_multimodal_prompt(
    messages: Sequence[dict[str, Any]],
    images: Sequence[Any],
    processor: ImageTextProcessor,
    **chat_template_kwargs: Any,
) -> MultimodalPrompt:
    """Chat template, image patches and expanded image tokens of one prompt (as HF's processor)."""
    kwargs = dict(chat_template_kwargs)
    if processor.chat_template and "chat_template" not in kwargs:
        kwargs["chat_template"] = processor.chat_template
    text = processor.tokenizer.apply_chat_template(
        content_parts(messages), add_generation_prompt=True, tokenize=False, **kwargs
    )
    token = processor.image_token
    if text.count(token) != len(images):
        raise ImageDataError(
            f"the chat template wrote {text.count(token)} '{token}' tokens for {len(images)} images; "
            "does it render {'type': 'image'} message parts?"
        )
    if images:
        features = processor.image_processor(images=list(images), return_tensors="pt")
        pixel_values, grid = features["pixel_values"], features["image_grid_thw"].long()
        pieces = text.split(token)
        counts = image_token_counts(grid, processor.merge_size)
        text = pieces[0] + "".join(token * n + piece for n, piece in zip(counts, pieces[1:]))
    else:
        pixel_values, grid = torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return MultimodalPrompt(input_ids=list(ids), pixel_values=pixel_values, image_grid_thw=grid)


def collate_multimodal_prompts(
    prompts: Sequence[MultimodalPrompt],
    *,
    pad_token_id: int,
    max_prompt_length: int,
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor] | None]]:
    """verl's prompt batch of image + text prompts: (``input_ids``, ``attention_mask`` [B, Tp]
    left-padded, ``position_ids`` [B, 3, Tp] 3-D rotary ids, 0 at padding), and each row's
    ``multi_modal_inputs`` (``{pixel_values, image_grid_thw}``, None without images) for
    ``non_tensor_batch``; the actor's ``workers/vl_inputs.py`` reads both. ValueError naming the row
    of a prompt longer than ``max_prompt_length``."""
    ids = torch.full((len(prompts), max_prompt_length), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    images: list[dict[str, torch.Tensor] | None] = []
    for row, prompt in enumerate(prompts):
        n = len(prompt.input_ids)
        if n > max_prompt_length:
            raise ValueError(f"prompt {row} has {n} tokens > max_prompt_length={max_prompt_length}")
        ids[row, max_prompt_length - n :] = torch.tensor(prompt.input_ids, dtype=torch.long)
        mask[row, max_prompt_length - n :] = 1
        has_images = prompt.image_grid_thw.shape[0] > 0
        images.append(
            {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
            if has_images
            else None
        )
    grids = [None if entry is None else entry["image_grid_thw"] for entry in images]
    positions = mrope_position_ids_batch(
        ids, mask, grids, image_token_id=image_token_id, spatial_merge_size=spatial_merge_size
    )
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions.transpose(0, 1).contiguous(),
    }
    return tensors, images


@dataclass
class EncodedImageRow:
    """A dataset row with images, ready to batch: its prompt ids [n], its images kept encoded
    (``images``: the bytes of each, decoded again by :func:`image_inputs` when a batch needs pixel
    values), their patch grids [n_images, 3] and its 3-D rotary ids [3, n] (left padding does not
    change them). No pixel values are held: they are float32 patches, about 8x the decoded image's
    bytes and far more than the encoded file's."""

    input_ids: list[int]
    images: tuple[bytes, ...]
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor


def encoded_image(entry: Any, where: str, *, base_dir: str | None = None) -> bytes:
    """The encoded bytes of one ``images`` entry: bytes as given, a file's bytes, a PIL image
    written as PNG (lossless: it decodes to the same RGB pixels)."""
    kind, value = _image_source(entry, where)
    if kind == "bytes":
        return value
    if kind == "path":
        path = _resolve_path(value, base_dir)
        if not os.path.isfile(path):
            raise ImageFileNotFoundError(f"{where}: image file '{path}' does not exist")
        with open(path, "rb") as f:
            return f.read()
    out = io.BytesIO()
    value.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def image_inputs(
    images: Sequence[bytes], processor: ImageTextProcessor, where: str
) -> dict[str, torch.Tensor]:
    """A row's ``multi_modal_inputs`` entry (``pixel_values``, ``image_grid_thw``) of its encoded images."""
    decoded = [load_image(data, f"{where}: image {i}") for i, data in enumerate(images)]
    features = processor.image_processor(images=decoded, return_tensors="pt")
    return {"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"].long()}


def encode_image_row(
    row: dict[str, Any],
    where: str,
    processor: ImageTextProcessor,
    *,
    messages: Sequence[dict[str, Any]],
    prompt_key: str,
    image_key: str,
    max_pixels: int | None,
    base_dir: str | None,
    chat_template_kwargs: dict[str, Any],
) -> EncodedImageRow:
    """Decode ``row``'s images (named errors say ``where``), encode its prompt as the processor
    does and compute its 3-D rotary ids (the trainer's dataset, ``data/dataset.py``); the pixel
    values are dropped, the images kept encoded. ``prompt_key`` is ``data.prompt_key``: the
    placeholders are counted in that column, as the start-up check counts them."""
    images = check_multimodal_row(
        row, where, prompt_key=prompt_key, image_key=image_key, max_pixels=max_pixels, base_dir=base_dir
    )
    prompt = encode_multimodal_prompt(messages, images, processor, **chat_template_kwargs)
    tensors, _ = collate_multimodal_prompts(
        [prompt],
        pad_token_id=0,
        max_prompt_length=len(prompt.input_ids),
        image_token_id=processor.image_token_id,
        spatial_merge_size=processor.merge_size,
    )
    encoded = tuple(
        encoded_image(entry, f"{where}: {image_key}[{i}]", base_dir=base_dir)
        for i, entry in enumerate(row[image_key])
    )
    return EncodedImageRow(prompt.input_ids, encoded, prompt.image_grid_thw, tensors["position_ids"][0])


def multimodal_columns(
    rows: Sequence[tuple[tuple[bytes, ...] | None, torch.Tensor | None]], processor: ImageTextProcessor | None
) -> dict[str, list[Any]]:
    """verl's two image columns of a prompt batch from each row's (encoded images, patch grids)
    (None, None for a text row): ``multi_modal_inputs`` (pixel values made now, for the actor and
    the native rollout) and ``multi_modal_data`` (``{"image": [encoded bytes]}``, what vLLM and
    SGLang take, decoded by the rollout). ValueError when there is no processor or it gives
    other grids than the dataset recorded at load."""
    if processor is None:
        raise ValueError("prompts with images need the image processor (collate_prompts(processor=...))")
    inputs: list[Any] = []
    data: list[Any] = []
    for row, (images, grids) in enumerate(rows):
        if not images:
            inputs.append(None)
            data.append(None)
            continue
        entry = image_inputs(images, processor, f"prompt {row}")
        if grids is not None and not torch.equal(entry["image_grid_thw"], grids.long()):
            raise ValueError(
                f"prompt {row}: the image processor gives patch grids {entry['image_grid_thw'].tolist()}, "
                f"the dataset recorded {grids.tolist()} (its prompt ids hold that many image tokens)"
            )
        inputs.append(entry)
        data.append({"image": list(images)})
    return {"multi_modal_inputs": inputs, "multi_modal_data": data}


def image_processor_for(path: str | os.PathLike) -> ImageTextProcessor | None:
    """The image + text processor of a checkpoint folder with an image processor
    (``preprocessor_config.json``), else None (a text-only checkpoint: rows with images are refused)."""
    if not os.path.isfile(os.path.join(os.fspath(path), "preprocessor_config.json")):
        return None
    return load_image_text_processor(path)


def batch_position_ids(
    rows: Sequence[torch.Tensor | None], lengths: Sequence[int], width: int
) -> torch.Tensor:
    """[B, 3, width] left-padded 3-D rotary ids (0 at padding) of rows' ids [3, n] (None: a text row
    of ``lengths[i]`` tokens, all three ids its index)."""
    out = torch.zeros(len(rows), 3, width, dtype=torch.long)
    for i, (ids, n) in enumerate(zip(rows, lengths)):
        out[i, :, width - n :] = torch.arange(n).expand(3, n) if ids is None else ids
    return out
