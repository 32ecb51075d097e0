"""hf_tokenizer: verl's pad and gemma-2 eos corrections on tokenizers built in a temporary folder."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verl_megatron.utils.tokenizer import hf_processor, hf_tokenizer, normalize_token_ids, set_pad_token_id


def save_word_tokenizer(out_dir: Path, special: dict[int, str], **token_kwargs: str) -> Path:
    """A whitespace word-level tokenizer with 110 ids: the given specials, a..j at 10..19, fillers elsewhere."""
    inv = {i: f"<unused{i}>" for i in range(110)}
    inv.update({i: c for i, c in enumerate("abcdefghij", start=10)})
    inv.update(special)
    tok = Tokenizer(models.WordLevel({t: i for i, t in inv.items()}, unk_token=inv[3]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=inv[3], **token_kwargs).save_pretrained(out_dir)
    return out_dir


GEMMA_SPECIALS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    106: "<start_of_turn>",
    107: "<end_of_turn>",
}


def test_missing_pad_falls_back_to_eos_with_warnings(tmp_path):
    path = save_word_tokenizer(tmp_path / "nopad", {1: "<eos>", 3: "<unk>"}, eos_token="<eos>")
    with pytest.warns(UserWarning, match="pad_token_id is None. Now set to 1"):
        tok = hf_tokenizer(str(path))
    assert (tok.pad_token_id, tok.pad_token) == (1, "<eos>")
    assert tok("a c j")["input_ids"] == [10, 12, 19]
    assert tok.decode([10, 12, 19]) == "a c j"
    padded = tok(["a", "a b c"], padding=True)["input_ids"]
    assert padded == [[10, 1, 1], [10, 11, 12]]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no correction requested: no warning either
        raw = hf_tokenizer(path, correct_pad_token=False)
    assert raw.pad_token_id is None and raw.eos_token_id == 1


def test_set_pad_token_id_keeps_existing_pad_and_rejects_no_eos(tmp_path):
    path = save_word_tokenizer(
        tmp_path / "withpad", {0: "<pad>", 1: "<eos>", 3: "<unk>"}, eos_token="<eos>", pad_token="<pad>"
    )
    tok = hf_tokenizer(path)
    set_pad_token_id(tok)
    assert (tok.pad_token_id, tok.pad_token) == (0, "<pad>")

    bare = hf_tokenizer(save_word_tokenizer(tmp_path / "bare", {3: "<unk>"}), correct_pad_token=False)
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        set_pad_token_id(bare)


def test_gemma2_eos_becomes_end_of_turn_id_107(tmp_path):
    path = save_word_tokenizer(
        tmp_path / "google" / "gemma-2-2b-it",
        GEMMA_SPECIALS,
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
    )
    with pytest.warns(UserWarning, match="Found gemma-2-2b-it tokenizer"):
        tok = hf_tokenizer(str(path))
    assert (tok.eos_token, tok.eos_token_id) == ("<end_of_turn>", 107)
    assert (tok.pad_token, tok.pad_token_id) == ("<pad>", 0)
    assert tok.decode([10, 107], skip_special_tokens=True) == "a"

    untouched = hf_tokenizer(str(path), correct_gemma2=False)
    assert (untouched.eos_token, untouched.eos_token_id) == ("<eos>", 1)


def test_gemma2_correction_needs_the_turn_token(tmp_path):
    no_turn = {k: v for k, v in GEMMA_SPECIALS.items() if v != "<end_of_turn>"}
    path = save_word_tokenizer(tmp_path / "gemma-2-2b-it-copy", no_turn, eos_token="<eos>", pad_token="<pad>")
    expected = r"gemma-2-2b-it-copy' is treated as gemma-2-2b-it but has no '<end_of_turn>'"
    with pytest.warns(UserWarning, match="Found gemma-2-2b-it"), pytest.raises(ValueError, match=expected):
        hf_tokenizer(path)

    moved = {**no_turn, 50: "<end_of_turn>"}
    path = save_word_tokenizer(tmp_path / "gemma-2-2b-it-moved", moved, eos_token="<eos>", pad_token="<pad>")
    with pytest.warns(UserWarning) as record:
        tok = hf_tokenizer(path)
    messages = [str(w.message) for w in record]
    assert messages == [
        "Found gemma-2-2b-it tokenizer. Set eos_token and eos_token_id to <end_of_turn> and 107.",
        f"'<end_of_turn>' has id 50 in '{path}', not 107 as in gemma-2-2b-it",
    ]
    assert tok.eos_token_id == 50


def test_missing_or_wrong_paths_name_the_path(tmp_path):
    missing = tmp_path / "no_such_tokenizer"
    with pytest.raises(FileNotFoundError, match=f"tokenizer directory '{missing}' does not exist"):
        hf_tokenizer(str(missing))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        hf_tokenizer(a_file)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory '.*empty_dir' holds none of"):
        hf_tokenizer(empty)


class _Encoding:
    """Stands in for transformers' BatchEncoding: ids under an ``input_ids`` attribute."""

    def __init__(self, input_ids):
        self.input_ids = input_ids


@pytest.mark.parametrize(
    "output",
    [
        [4, 5, 6],
        (4, 5, 6),
        np.array([4, 5, 6]),
        torch.tensor([4, 5, 6]),
        torch.tensor([[4, 5, 6]]),  # a batch of one
        {"input_ids": [4, 5, 6], "attention_mask": [1, 1, 1]},
        {"input_ids": [[4, 5, 6]]},
        _Encoding(torch.tensor([[4, 5, 6]])),
        [np.int32(4), np.int64(5), torch.tensor(6)],
    ],
)
def test_normalize_token_ids_flattens_every_tokenizer_output(output):
    ids = normalize_token_ids(output)
    assert ids == [4, 5, 6]
    assert all(type(i) is int for i in ids)


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ("4 5 6", "expected token ids, got str"),
        ({"attention_mask": [1, 1]}, "expected token ids, got dict"),
        ([[4, 5], [6, 7]], "token 0 is a list"),
        ([4, 5.5], "token 1 is a float"),
        ([4, None], "token 1 is a NoneType"),
    ],
)
def test_normalize_token_ids_rejects_non_ids_with_type_error(output, match):
    with pytest.raises(TypeError, match=match):
        normalize_token_ids(output)


def test_hf_processor_is_none_for_a_text_only_model(tmp_path):
    folder = save_word_tokenizer(tmp_path / "tok", {0: "<pad>", 1: "<eos>", 3: "<unk>"}, eos_token="<eos>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hf_processor(str(folder)) is None
    with pytest.raises(FileNotFoundError, match="processor directory '/nonexistent/model' does not exist"):
        hf_processor("/nonexistent/model")
