"""The vision-language quickstart's parts: shapes data, word tokenizer, scorer, and image tokens in
responses.

configs/quickstart_vl.yaml trains a random-init tiny Qwen2.5-VL on ``data/shapes_task.py``'s
images (its one step runs in tests/test_recipes.py; its learning curve is
benchmarks/results/vl_learning.json). Here: the rows ask for the square's colour and the pixels
agree (the square's cell holds the answer's colour, the circle's another one), validation layouts
are never trained on, every colour is one token and a prompt is 15 tokens with 4 image tokens,
and the scorer gives right / right-but-not-stopped / wrong / garbage answers 1 / 0.5 / 0 / 0.

A 20-word policy samples ``<|image_pad|>`` in its answers (the first learning run did): the
actor must embed such a response token as text, as the rollout did, and put image features at
the prompt's image tokens only (before the fix: "the micro-batch has 1046 image tokens but its
images give 1024 features").
"""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest
import torch

from verl_megatron.data.shapes_task import CELL, COLOURS, DATA_SOURCE, WORDS, write_shapes_dataset
from verl_megatron.reward.scorers import default_compute_score


@pytest.mark.parametrize(
    "answer, score",
    [("red", 1.0), (" Red ", 1.0), ("red red", 0.5), ("red?", 0.5), ("blue", 0.0), ("green red", 0.0),
     ("?", 0.0), ("", 0.0), ("the square is red", 0.0), ("redblue", 0.0)],
)  # fmt: skip
def test_scorer_rates_right_wrong_and_garbage_answers(answer, score):
    assert default_compute_score(DATA_SOURCE, answer, "red") == score, answer


def test_scorer_refuses_a_ground_truth_that_is_not_a_word():
    with pytest.raises(ValueError, match="colour word"):
        default_compute_score(DATA_SOURCE, "red", "3")


def _cell_colour(image, cell: int) -> str | None:
    """The colour name at the middle of ``cell`` (row-major 28-pixel cells), None for background."""
    x, y = (cell % 2) * CELL + CELL // 2, (cell // 2) * CELL + CELL // 2
    pixel = image.getpixel((x, y))
    return next((name for name, rgb in COLOURS.items() if rgb == pixel), None)


def test_rows_ask_for_the_square_colour_and_the_pixels_agree(tmp_path):
    from PIL import Image

    train, val = write_shapes_dataset(tmp_path, num_train=116, num_val=28, seed=0)
    rows = {split: pq.read_table(path).to_pylist() for split, path in (("train", train), ("val", val))}
    layouts = {}
    for split, split_rows in rows.items():
        for row in split_rows:
            image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
            assert (
                image.size == (56, 56) and row["prompt"][0]["content"] == "<image>What colour is the square?"
            )
            colours = [_cell_colour(image, cell) for cell in range(4)]
            square, circle = row["reward_model"]["ground_truth"], row["extra_info"]["circle"]
            assert sorted(c for c in colours if c) == sorted([square, circle]) and square != circle, colours
            # The square fills its cell's corner region; the circle leaves it background.
            cell = colours.index(square)
            corner = ((cell % 2) * CELL + 6, (cell // 2) * CELL + 6)
            assert image.getpixel(corner) == COLOURS[square], (row["extra_info"], corner)
            layouts.setdefault(split, set()).add((square, circle, cell, colours.index(circle)))
    assert len(layouts["train"]) == 144 - 28 and len(layouts["val"]) == 28
    assert not layouts["train"] & layouts["val"]
    for split, count in (("train", 29), ("val", 7)):
        answers = [row["reward_model"]["ground_truth"] for row in rows[split]]
        assert {a: answers.count(a) for a in COLOURS} == {a: count for a in COLOURS}, split


def test_every_colour_is_one_token_and_a_prompt_has_four_image_tokens(tmp_path):
    from verl_megatron.data.multimodal import ImageTextProcessor, encode_multimodal_prompt
    from verl_megatron.data.shapes_task import shapes_image
    from verl_megatron.utils.local_vl_assets import _image_processor
    from verl_megatron.utils.vl_word_tokenizer import build_vl_word_tokenizer

    tokenizer = build_vl_word_tokenizer(tmp_path, WORDS)
    assert len(tokenizer) == 20
    for colour in COLOURS:
        (token,) = tokenizer(colour, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([token, tokenizer.eos_token_id], skip_special_tokens=True) == colour
    processor = ImageTextProcessor(tokenizer, _image_processor(28 * 28 * 64))
    messages = [{"role": "user", "content": "<image>What colour is the square?"}]
    prompt = encode_multimodal_prompt(
        messages, [shapes_image(("red", 0), ("blue", 3), (0, 0, 0, 0))], processor
    )
    ids = prompt.input_ids
    assert len(ids) == 15 and ids.count(processor.image_token_id) == 4, tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.unk_token_id not in ids and prompt.image_grid_thw.tolist() == [[1, 4, 4]]


def test_image_token_in_a_response_stays_text():
    """Two rows (prompt 4 columns with 1 image token, response 2 columns); row 1's response has
    the image token. Padded and packed layouts mark the prompt columns; features go to the prompt's tokens."""
    from verl_megatron.models.families.qwen2_vl_model import place_image_features
    from verl_megatron.workers.batching import build_micro_batches
    from verl_megatron.workers.vl_inputs import RowImages

    img = 9
    ids = torch.tensor([[0, 5, img, 6, 7, 1], [5, img, 6, 7, img, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    images = RowImages(
        pixel_values=(torch.ones(4, 3), torch.ones(4, 3)),
        image_grid_thw=(torch.tensor([[1, 2, 2]]), torch.tensor([[1, 2, 2]])),
        position_ids=torch.arange(6).expand(2, 3, 6).clone(),
    )
    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 4:], "row_images": images}
    for pack in (False, True):
        (micro,) = build_micro_batches(batch, [[0, 1]], pack=pack)
        inputs = micro.inputs
        keep = inputs.input_ids != 0 if inputs.padding is None else ~inputs.padding
        # Row-major: row 0's prompt (5 img 6) and response (7 1), row 1's (5 img 6 7) and (img 1).
        assert inputs.input_ids[inputs.prompt_mask].tolist() == [5, img, 6, 5, img, 6, 7], (pack, inputs)
        assert inputs.input_ids[keep & ~inputs.prompt_mask].tolist() == [7, 1, img, 1], (pack, inputs)
        embeddings = torch.zeros(*inputs.input_ids.shape[::-1], 2)
        features = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
        placed = place_image_features(embeddings, inputs.input_ids, features, img, inputs.prompt_mask)
        taken = placed.transpose(0, 1)[..., 0]
        assert taken[inputs.input_ids == img].tolist().count(0.0) == 1, taken  # the response's one
        assert sorted(taken[inputs.prompt_mask & (inputs.input_ids == img)].tolist()) == [1.0, 2.0]
        with pytest.raises(ValueError, match="3 image tokens but its images give 2 features"):
            place_image_features(embeddings, inputs.input_ids, features, img)
