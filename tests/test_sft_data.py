"""SFT rows -> tokens: the chat template writes the conversation, the loss mask covers exactly the
assistant's tokens (every turn, with the template's end-of-turn token), and bad rows are named."""

from __future__ import annotations

import json

import pytest

from verl_megatron.data.config import DataConfig
from verl_megatron.data.dataset import DataFormatError
from verl_megatron.data.sft_config import SFTConfig


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from verl_megatron.utils.local_assets import build_char_tokenizer

    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")), alphabet="0123456789abc")


def _dataset(tmp_path, rows, tokenizer, **sft):
    from verl_megatron.data.sft_dataset import SFTDataset

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SFTDataset([str(path)], tokenizer, SFTConfig(**sft), DataConfig())


def _trained_text(tokenizer, item) -> list[str]:
    """The trained spans of an item, decoded."""
    spans, current = [], []
    for token, trained in zip(item.input_ids, item.loss_mask):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current)), current.clear()
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def test_every_assistant_turn_is_trained_and_nothing_else(tmp_path, tokenizer):
    chat = [
        {"role": "system", "content": "c"},
        {"role": "user", "content": "12"},
        {"role": "assistant", "content": "21"},
        {"role": "user", "content": "345"},
        {"role": "assistant", "content": "543"},
    ]
    rows = [{"messages": chat}, {"prompt": "67", "response": "76"}, {"prompt": chat[:2], "response": "a"}]
    data = _dataset(tmp_path, rows, tokenizer)
    whole = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(data[0].input_ids) == whole
    assert _trained_text(tokenizer, data[0]) == ["21<|endoftext|>", "543<|endoftext|>"]
    assert _trained_text(tokenizer, data[1]) == ["76<|endoftext|>"]
    assert _trained_text(tokenizer, data[2]) == ["a<|endoftext|>"]
    # The actor's layout: token t+1 is the target of position t, masked as trained or not.
    from verl_megatron.data.sft_dataset import collate_sft

    batch = collate_sft([data[1], data[0]], pad_token_id=0).batch
    n = len(data[1].input_ids)
    assert batch["responses"][0, : n - 1].tolist() == data[1].input_ids[1:]
    assert batch["response_mask"][0].tolist() == [
        *map(float, data[1].loss_mask[1:]),
        *[0.0] * (len(data[0].input_ids) - n),
    ]
    assert batch["attention_mask"][0].sum() == n


def test_a_prompt_response_row_trains_on_its_response_alone(tmp_path, tokenizer):
    """Assistant turns inside a list-valued prompt are context, as verl masks the whole prompt;
    a ``messages`` chat with the same turns trains on each of them."""
    turns = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "99"}]
    turns.append({"role": "user", "content": "34"})
    chat = [*turns, {"role": "assistant", "content": "43"}]
    data = _dataset(tmp_path, [{"prompt": turns, "response": "43"}, {"messages": chat}], tokenizer)
    assert _trained_text(tokenizer, data[0]) == ["43<|endoftext|>"]
    assert _trained_text(tokenizer, data[1]) == ["99<|endoftext|>", "43<|endoftext|>"]
    assert data[0].input_ids == data[1].input_ids  # the same tokens, only the mask differs


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"text": "x"}, r"rows.jsonl: row 1: needs field 'messages'"),
        ({"messages": [{"role": "user", "content": "1"}]}, r"row 1: the chat has no assistant message"),
        ({"messages": [{"role": "user"}]}, r"row 1: field 'messages\[0\]' must be a dict"),
        ({"prompt": "1", "response": 3}, r"row 1: field 'response' must be a string"),
        (
            {"prompt": "1", "response": "1" * 40},
            r"row 1: 4\d tokens after the chat template > sft.max_length=16",
        ),
    ],
)
def test_bad_rows_are_named(tmp_path, tokenizer, row, match):
    good = {"prompt": "1", "response": "2"}
    with pytest.raises(DataFormatError, match=match):
        _dataset(tmp_path, [good, row], tokenizer, max_length=16)


def test_right_truncation_and_a_template_that_rewrites_history(tmp_path, tokenizer):
    data = _dataset(
        tmp_path, [{"prompt": "1", "response": "2" * 40}], tokenizer, max_length=16, truncation="right"
    )
    assert len(data[0].input_ids) == 16 and data.num_truncated == 1
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(
        DataFormatError, match=r"row 0: the chat template rewrites earlier text when message 1"
    ):
        _dataset(tmp_path, [{"prompt": "1", "response": "2"}], tokenizer)


def test_files_are_checked_without_a_tokenizer(tmp_path):
    from verl_megatron.data.sft_dataset import check_sft_files

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1", "response": "2"}) + "\n" + json.dumps({"prompt": "1"}) + "\n")
    with pytest.raises(DataFormatError, match=r"rows.jsonl: row 1: needs field 'messages'"):
        check_sft_files([str(path)], SFTConfig(), "images")


def test_rows_with_images_are_refused_naming_file_row_and_key(tmp_path, tokenizer):
    """SFT is text only: a row's images would be dropped and the literal "<image>" trained on."""
    from verl_megatron.data.sft_dataset import check_sft_files
    from verl_megatron.data.synthetic import write_parquet

    chat = [{"role": "user", "content": "<image>1"}, {"role": "assistant", "content": "2"}]
    rows = [{"messages": chat, "pics": []}, {"messages": chat, "pics": [{"bytes": b"png", "path": None}]}]
    path = str(tmp_path / "vl.parquet")
    write_parquet(rows, path)
    assert check_sft_files([path], SFTConfig(), "images") == 2  # another column: not images
    match = r"vl.parquet: row 1: field 'pics' \(data.image_key\) holds images, but SFT trains on text only"
    with pytest.raises(DataFormatError, match=match):
        check_sft_files([path], SFTConfig(), "pics")
    from verl_megatron.data.sft_dataset import SFTDataset

    with pytest.raises(DataFormatError, match=match):
        SFTDataset([path], tokenizer, SFTConfig(), DataConfig(image_key="pics"))
    assert len(SFTDataset([path], tokenizer, SFTConfig(), DataConfig())) == 2


def test_sft_command_names_a_bad_row_before_any_model(tmp_path, no_runtime, capsys):
    """``verl-megatron sft`` (configs/sft_quickstart.yaml by default, trainer.mode=sft) checks every
    row at start-up: one ``error:`` line naming the file and row, exit status 2, no process group."""
    from verl_megatron import cli

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1", "response": "2"}) + "\n" + json.dumps({"messages": []}) + "\n")
    overrides = [f"data.train_files=[{path}]", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1",
                 f"trainer.default_local_dir={tmp_path / 'out'}"]  # fmt: skip
    assert cli.main(["sft", *overrides]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "rows.jsonl: row 1: field 'messages' must be a non-empty list" in err, err
    from verl_megatron.train import run_mode

    assert run_mode(None, ["trainer.mode=sft"]) == "sft" and run_mode(None, []) == "rl"
    from verl_megatron.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.mode='dpo'"):
        run_mode(None, ["trainer.mode=dpo"])
