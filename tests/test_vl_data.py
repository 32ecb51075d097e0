"""Multimodal rows: images in every form verl rows carry them, the start-up errors that name the
row, and prompts encoded as Qwen2-VL's processor does (one image token per merged patch block)."""

from __future__ import annotations

import io
import json
import warnings

import pytest
import torch

from tests.helpers import saved_model
from verl_megatron.data.config import DataConfig
from verl_megatron.data.dataset import check_data_files
from verl_megatron.data.multimodal import (
    ImageDataError,
    ImageDecodeError,
    ImageFileNotFoundError,
    ImagePlaceholderError,
    ImageTooLargeError,
    check_multimodal_row,
    encode_multimodal_prompt,
    load_image_text_processor,
)
from verl_megatron.errors import UserInputError
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, shape_image


def _png(size=(40, 30), colour="red") -> bytes:
    buffer = io.BytesIO()
    shape_image(size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(images, text="<image>What colour is the square?") -> dict:
    return {
        "prompt": [{"role": "user", "content": text}],
        "images": images,
        "data_source": "shapes",
        "reward_model": {"ground_truth": "red"},
    }


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen2_5_vl_data", build_tiny_qwen2_5_vl)


def test_every_image_form_loads(tmp_path):
    (tmp_path / "sub").mkdir()
    shape_image((20, 10), "blue").save(tmp_path / "sub" / "a.png")
    entries = [
        _png(),  # raw bytes
        {"bytes": _png((8, 6)), "path": None},  # datasets' parquet struct
        str(tmp_path / "sub" / "a.png"),  # absolute path
        "file://" + str(tmp_path / "sub" / "a.png"),
        {"image": "sub/a.png"},  # relative to the data file's folder
        shape_image((5, 7), "green").convert("L"),  # a PIL image (converted to RGB)
    ]
    images = check_multimodal_row(_row(entries, "<image>" * len(entries)), "row 0", base_dir=str(tmp_path))
    assert [im.size for im in images] == [(40, 30), (8, 6), (20, 10), (20, 10), (20, 10), (5, 7)]
    assert all(im.mode == "RGB" for im in images)
    assert images[0].getpixel((20, 15)) == (220, 30, 30)  # the square's colour survived


@pytest.mark.parametrize(
    ("entries", "text", "error", "words"),
    [
        (["/nonexistent/x.png"], "<image>", ImageFileNotFoundError, ["images[0]", "/nonexistent/x.png"]),
        ([b"not an image at all"], "<image>", ImageDecodeError, ["images[0]", "19 image bytes"]),
        ([_png()[:60]], "<image>", ImageDecodeError, ["images[0]", "do not decode"]),  # truncated
        ([_png(), _png((200, 100))], "<image><image>", ImageTooLargeError, ["images[1]", "200x100", "max_image_pixels=10000"]),
        ([_png()], "no placeholder", ImagePlaceholderError, ["0 '<image>' placeholders", "1 images"]),
        ([], "<image>", ImagePlaceholderError, ["1 '<image>' placeholders", "0 images"]),
        ([{"path": None}], "<image>", ImageDataError, ["none of 'bytes', 'image', 'path'"]),
    ],
    ids=["missing", "garbage", "truncated", "too-large", "no-placeholder", "no-image", "empty-dict"],
)  # fmt: skip
def test_bad_images_raise_named_errors(tmp_path, entries, text, error, words):
    with pytest.raises(error) as info:
        check_multimodal_row(_row(entries, text), "data.jsonl: row 7", max_pixels=10_000)
    message = str(info.value)
    assert isinstance(info.value, UserInputError) and "\n" not in message
    for word in ["data.jsonl: row 7", *words]:
        assert word in message, message


def test_start_up_check_names_file_and_row(tmp_path):
    good, bad = _row([{"bytes": None, "path": "a.png"}]), _row([{"path": "missing.png"}])
    shape_image((10, 10), "red").save(tmp_path / "a.png")
    path = tmp_path / "rows.jsonl"
    rows = [_row(None, "text only"), good, bad]
    rows[0].pop("images")
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(
        ImageFileNotFoundError, match=r"rows\.jsonl: row 2: images\[0\]: image file .*missing\.png"
    ):
        check_data_files([str(path)], DataConfig())
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]))
    assert check_data_files([str(path)], DataConfig()) == 2
    with pytest.raises(ImageTooLargeError, match="row 1"):
        check_data_files([str(path)], DataConfig(max_image_pixels=99))


def test_prompt_encoding_expands_image_tokens(vl_path):
    from verl_megatron.utils.tokenizer import hf_processor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = load_image_text_processor(vl_path, hf_processor(vl_path))
    images = [shape_image((112, 84), "red"), shape_image((56, 56), "blue", "circle")]
    messages = [{"role": "user", "content": "Is <image> like <image>?"}]
    encoded = encode_multimodal_prompt(messages, images, processor)
    tokenizer = processor.tokenizer
    assert encoded.image_grid_thw.tolist() == [[1, 6, 8], [1, 4, 4]]  # (t, h, w) patches of 14 pixels
    assert encoded.pixel_values.shape == (48 + 16, 3 * 2 * 14 * 14)
    ids = encoded.input_ids
    pad, start, end = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    first = ids.index(start)
    assert ids[first + 1 : first + 13] == [pad] * 12 and ids[first + 13] == end  # 6 * 8 / 2^2 tokens
    second = ids.index(start, first + 1)
    assert ids[second + 1 : second + 5] == [pad] * 4 and ids[second + 5] == end
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nIs ") and text.endswith("?<|im_end|>\n<|im_start|>assistant\n")
    assert torch.equal(
        encoded.pixel_values[:48],
        processor.image_processor(images=images[:1], return_tensors="pt")["pixel_values"],
    )


def test_processor_needs_an_image_processor(tmp_path):
    with pytest.raises(ImageDataError, match=r"no preprocessor_config\.json"):
        load_image_text_processor(tmp_path)


def test_trainer_dataset_encodes_image_rows_into_the_prompt_batch(tmp_path, vl_path):
    """With the checkpoint's image processor the dataset's batch is ``collate_multimodal_prompts``
    of the encoded prompts (ids, mask, [B, 3, Tp] ids, images); without one, image rows are refused."""
    from verl_megatron.data.dataset import DataFormatError, RLHFDataset, collate_prompts
    from verl_megatron.data.multimodal import (
        MultimodalPrompt,
        collate_multimodal_prompts,
        image_processor_for,
    )
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen2_vl import check_vl_rollout
    from verl_megatron.utils.tokenizer import hf_tokenizer

    (tmp_path / "a.png").write_bytes(_png((56, 84), "blue"))
    path = tmp_path / "rows.jsonl"
    text_only = _row([], "What colour is a tomato?")
    path.write_text(json.dumps(text_only) + "\n" + json.dumps(_row([{"path": "a.png"}])))
    with pytest.raises(DataFormatError, match=r"rows\.jsonl: row 1: field 'images' holds images but model"):
        RLHFDataset([str(path)], hf_tokenizer(vl_path), DataConfig())
    assert image_processor_for(tmp_path) is None
    processor = image_processor_for(vl_path)
    dataset = RLHFDataset([str(path)], processor.tokenizer, DataConfig(max_prompt_length=40), processor)
    batch = collate_prompts(dataset.items, 0, 40, processor=processor)
    images = [shape_image((56, 84), "blue")]
    encoded = [
        encode_multimodal_prompt(text_only["prompt"], [], processor),
        encode_multimodal_prompt(_row([])["prompt"], images, processor),
    ]
    prompts = [MultimodalPrompt(e.input_ids, e.pixel_values, e.image_grid_thw) for e in encoded]
    expected, entries = collate_multimodal_prompts(
        prompts, pad_token_id=0, max_prompt_length=40, image_token_id=processor.image_token_id,
        spatial_merge_size=processor.merge_size,
    )  # fmt: skip
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(batch.batch[key], expected[key]), key
    column = batch.non_tensor_batch["multi_modal_inputs"]
    assert column[0] is None and torch.equal(column[1]["pixel_values"], entries[1]["pixel_values"])
    assert column[1]["image_grid_thw"].tolist() == [[1, 6, 4]]  # 84 x 56 pixels, patches of 14
    with pytest.raises(DataFormatError, match="image tokens cannot be cut"):
        short = DataConfig(max_prompt_length=len(dataset.items[1].input_ids) - 1)  # the text row fits
        RLHFDataset([str(path)], processor.tokenizer, short, processor)
    with pytest.raises(ModelConfigError, match=r"rollout\.name=hf does not pass images"):
        check_vl_rollout("qwen2_5_vl", "hf")
    for engine in ("native", "vllm", "sglang"):
        check_vl_rollout("qwen2_5_vl", engine)


def test_dataset_reads_image_rows_under_the_configured_prompt_key(tmp_path, vl_path):
    """``data.prompt_key`` names the messages column both at the start-up check and while the
    dataset encodes the row: the image placeholders are counted in that column, not in "prompt"."""
    import pandas as pd

    from verl_megatron.data.dataset import RLHFDataset
    from verl_megatron.data.multimodal import image_processor_for

    row = _row([_png((56, 84), "blue")])
    row["question"] = row.pop("prompt")
    path = tmp_path / "rows.parquet"
    pd.DataFrame([row]).to_parquet(path)
    config = DataConfig(prompt_key="question", max_prompt_length=40)
    assert check_data_files([str(path)], config) == 1
    processor = image_processor_for(vl_path)
    dataset = RLHFDataset([str(path)], processor.tokenizer, config, processor)
    expected = encode_multimodal_prompt(row["question"], [shape_image((56, 84), "blue")], processor)
    assert len(dataset) == 1
    assert dataset.items[0].input_ids == expected.input_ids
    # 84 x 56 pixels: 6 x 4 patches of 14, merged 2 x 2 into 6 image tokens
    assert dataset.items[0].input_ids.count(processor.image_token_id) == 6
