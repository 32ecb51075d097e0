"""Prompt data: verl rows from parquet/jsonl, chat template, over-long prompts, collation,
the seeded resumable loader, and the synthetic / GSM8K generators."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl_megatron.data import DataConfig, DataFormatError, PromptLoader, RLHFDataset, collate_prompts
from verl_megatron.data.gsm8k_format import INSTRUCTION, convert_rows, extract_solution
from verl_megatron.data.gsm8k_format import main as gsm8k_main
from verl_megatron.data.synthetic import main as synthetic_main
from verl_megatron.data.synthetic import write_synthetic_dataset
from verl_megatron.utils.local_assets import build_char_tokenizer
from verl_megatron.utils.reward_score import default_compute_score

# Char tokenizer over digits: <pad> 0, eos 1, <unk> 2, <|system|> 3, <|user|> 4, <|assistant|> 5, '0'..'9' -> 6..15.
USER, EOS, ASSISTANT, PAD = 4, 1, 5, 0


def _digit_ids(text: str) -> list[int]:
    return [6 + int(c) for c in text]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"), alphabet="0123456789")


def _row(content: str, truth: str, **extra) -> dict:
    row = {
        "data_source": "synthetic/copy",
        "prompt": [{"role": "user", "content": content}],
        "ability": "synthetic",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": 7},
    }
    row.update(extra)
    return row


def _write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_synthetic_parquet_rows_tokenize_through_the_chat_template(tmp_path, tokenizer):
    train, val = write_synthetic_dataset(tmp_path, task="reverse", num_digits=3, val_fraction=0.2, seed=0)
    config = DataConfig(max_prompt_length=8)
    train_set, val_set = RLHFDataset(train, tokenizer, config), RLHFDataset(val, tokenizer, config)
    assert (len(train_set), len(val_set)) == (800, 200)
    prompts = {item.raw_prompt[0]["content"] for item in train_set.items}
    held_out = {item.raw_prompt[0]["content"] for item in val_set.items}
    assert len(prompts | held_out) == 1000 and not prompts & held_out
    item = train_set[0]
    digits = item.raw_prompt[0]["content"]
    # "<|user|>abc<|endoftext|><|assistant|>"
    assert item.input_ids == [USER, *_digit_ids(digits), EOS, ASSISTANT]
    assert item.reward_model["ground_truth"] == digits[::-1]
    assert item.data_source == "synthetic/reverse" and item.index == 0
    assert default_compute_score("synthetic/reverse", digits[::-1], item.reward_model["ground_truth"]) == 1.0


def test_collate_left_pads_and_counts_positions(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row("12", "12"), _row("3456", "3456")])
    dataset = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=8, return_raw_chat=True))
    batch = collate_prompts(dataset.items, pad_token_id=PAD, max_prompt_length=8, return_raw_chat=True)
    expected_ids = torch.tensor(
        [
            [PAD, PAD, PAD, USER, 7, 8, EOS, ASSISTANT],
            [PAD, USER, 9, 10, 11, 12, EOS, ASSISTANT],
        ]
    )
    assert torch.equal(batch.batch["input_ids"], expected_ids)
    assert torch.equal(batch.batch["attention_mask"], (expected_ids != PAD).long())
    assert torch.equal(
        batch.batch["position_ids"], torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5, 6]])
    )
    assert list(batch.non_tensor_batch["data_source"]) == ["synthetic/copy"] * 2
    assert batch.non_tensor_batch["reward_model"][1]["ground_truth"] == "3456"
    assert batch.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": "12"}]
    assert list(batch.non_tensor_batch["index"]) == [7, 7]


@pytest.mark.parametrize(
    ("bad_row", "field"),
    [
        (
            {"prompt": [{"role": "user", "content": "1"}], "reward_model": {"ground_truth": "1"}},
            "data_source",
        ),
        (_row("1", "1", prompt="just a string"), "prompt"),
        (_row("1", "1", prompt=[{"role": "user"}]), "prompt[0]"),
        (_row("1", "1", reward_model={"style": "rule"}), "reward_model"),
        (_row("1", "1", extra_info=[1, 2]), "extra_info"),
    ],
)
def test_malformed_row_names_file_row_and_field(tokenizer, tmp_path, bad_row, field):
    path = _write_jsonl(tmp_path / "bad.jsonl", [_row("1", "1"), _row("2", "2"), bad_row])
    with pytest.raises(DataFormatError) as err:
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=8))
    message = str(err.value)
    assert path in message and "row 2" in message and f"'{field}'" in message


def test_invalid_json_line_and_unknown_extension(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "broken.jsonl", [_row("1", "1"), "{not json"])
    with pytest.raises(DataFormatError, match=r"broken.jsonl: line 2 is not valid JSON"):
        RLHFDataset(path, tokenizer, DataConfig())
    (tmp_path / "x.csv").write_text("data_source,prompt\n")
    with pytest.raises(DataFormatError, match="unsupported extension"):
        RLHFDataset(str(tmp_path / "x.csv"), tokenizer, DataConfig())
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        RLHFDataset(str(tmp_path / "missing.parquet"), tokenizer, DataConfig())


def test_overlong_prompts_filtered_with_count_or_rejected_or_cut(tokenizer, tmp_path):
    # Prompt tokens = digits + 3 (user marker, eos, assistant marker); limit 6 allows 3 digits.
    rows = [_row("123", "1"), _row("1234", "1"), _row("12", "1"), _row("123456", "1")]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    filtered = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=6, filter_overlong_prompts=True))
    assert (len(filtered), filtered.num_filtered) == (2, 2)
    with pytest.raises(DataFormatError, match=r"row 1: prompt has 7 tokens > data.max_prompt_length=6"):
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=6, truncation="error"))
    left = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=6, truncation="left"))
    assert left.num_truncated == 2
    assert left[1].input_ids == [*_digit_ids("1234"), EOS, ASSISTANT]
    right = RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=6, truncation="right"))
    assert right[1].input_ids == [USER, *_digit_ids("1234"), EOS]
    with pytest.raises(DataFormatError, match="no prompts left"):
        RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=3, filter_overlong_prompts=True))


def _ids(batch) -> list[int]:
    return [int(row["index"]) for row in batch.non_tensor_batch["extra_info"]]


@pytest.fixture(scope="module")
def numbered_dataset(tokenizer, tmp_path_factory):
    rows = [_row(str(i % 10), "1", extra_info={"index": i}) for i in range(10)]
    path = _write_jsonl(tmp_path_factory.mktemp("d") / "n.jsonl", rows)
    return RLHFDataset(path, tokenizer, DataConfig(max_prompt_length=8))


def test_loader_epochs_are_seeded_permutations_dropping_the_remainder(numbered_dataset):
    loader = PromptLoader(numbered_dataset, 3, shuffle=True, seed=5, pad_token_id=PAD)
    assert len(loader) == 3
    epoch0 = [_ids(loader.next_batch()) for _ in range(3)]
    expected = np.random.default_rng([5, 0]).permutation(10)[:9].reshape(3, 3).tolist()
    assert epoch0 == expected
    epoch1 = [_ids(loader.next_batch()) for _ in range(3)]
    assert epoch1 == np.random.default_rng([5, 1]).permutation(10)[:9].reshape(3, 3).tolist()
    assert epoch1 != epoch0 and loader.state_dict() == {
        "epoch": 1, "batch_in_epoch": 3, "seed": 5, "rows_in_epoch": 9, "num_rows": 10,
    }  # fmt: skip
    same_seed = PromptLoader(numbered_dataset, 3, shuffle=True, seed=5, pad_token_id=PAD)
    assert _ids(same_seed.next_batch()) == epoch0[0]
    in_order = PromptLoader(numbered_dataset, 3, shuffle=False, seed=5, pad_token_id=PAD)
    assert _ids(in_order.next_batch()) == [0, 1, 2]


def test_loader_resumes_mid_epoch_and_across_epochs(numbered_dataset):
    uninterrupted = PromptLoader(numbered_dataset, 4, shuffle=True, seed=1, pad_token_id=PAD)
    reference = [_ids(uninterrupted.next_batch()) for _ in range(7)]
    first = PromptLoader(numbered_dataset, 4, shuffle=True, seed=1, pad_token_id=PAD)
    for _ in range(3):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through a file
    resumed = PromptLoader(numbered_dataset, 4, shuffle=True, seed=1, pad_token_id=PAD)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()) for _ in range(4)] == reference[3:]
    other_seed = PromptLoader(numbered_dataset, 4, shuffle=True, seed=2, pad_token_id=PAD)
    with pytest.raises(ValueError, match="seed 1"):
        other_seed.load_state_dict(state)


def test_loader_rejects_a_dataset_smaller_than_one_batch(numbered_dataset):
    with pytest.raises(ValueError, match="10 prompts, fewer than one batch of 16"):
        PromptLoader(numbered_dataset, 16, shuffle=True, seed=0, pad_token_id=PAD)


def test_synthetic_cli_writes_copy_task(tmp_path):
    synthetic_main(["--task", "copy", "--out", str(tmp_path), "--num-digits", "2", "--val-fraction", "0.1"])
    import pyarrow.parquet as pq

    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    val = pq.read_table(tmp_path / "val.parquet").to_pylist()
    assert (len(train), len(val)) == (90, 10)
    assert all(r["reward_model"]["ground_truth"] == r["prompt"][0]["content"] for r in train + val)
    assert {r["data_source"] for r in train} == {"synthetic/copy"}


def test_gsm8k_conversion(tmp_path, tokenizer):
    assert extract_solution("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert extract_solution("#### -3.5") == "-3.5"
    assert extract_solution("no marker") is None
    src = _write_jsonl(
        tmp_path / "gsm8k_test.jsonl",
        [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, {"question": "Q2", "answer": "#### 1,000"}],
    )
    assert gsm8k_main(["--in", src, "--split", "test", "--out", str(tmp_path / "out")]) == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "1000"]
    assert rows[0]["prompt"] == [{"role": "user", "content": f"What is 2+2? {INSTRUCTION}"}]
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, "answer": "#### 1,000", "question": "Q2"}
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    with pytest.raises(
        DataFormatError, match=r"in.jsonl: row 1: field 'answer' has no final '#### <number>'"
    ):
        convert_rows(
            [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "2"}], "train", "in.jsonl"
        )


def _gsm8k_records() -> list[dict]:
    return [
        {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
        {"question": "Q2", "answer": "#### 1,000"},
    ]


@pytest.mark.parametrize("form", ["json array", "jsonl with BOM", "json array with BOM"])
def test_gsm8k_reads_json_arrays_and_byte_order_marks(tmp_path, form):
    records = _gsm8k_records()
    text = json.dumps(records) if "array" in form else "\n".join(json.dumps(r) for r in records) + "\n"
    src = tmp_path / ("in.json" if "array" in form else "in.jsonl")
    src.write_text(text, encoding="utf-8-sig" if "BOM" in form else "utf-8")
    assert gsm8k_main(["--in", str(src), "--split", "train", "--out", str(tmp_path / "out")]) == 0
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["4", "1000"]


def test_gsm8k_split_comes_from_the_flag_not_the_file_name(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "gsm8k_test.jsonl", _gsm8k_records())
    assert gsm8k_main(["--in", src, "--split", "train", "--out", str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.parquet"]
    with pytest.raises(SystemExit):  # --split is required
        gsm8k_main(["--in", src, "--out", str(tmp_path / "out")])
    assert "--split" in capsys.readouterr().err
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    assert gsm8k_main(["--in", bad, "--split", "test", "--out", str(tmp_path / "o2")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {bad}: line 1 is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    )
