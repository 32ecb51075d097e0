"""Prompt rows' ``extra_info.index`` (None, strings) and the loader's resume position across a
changed batch size or dataset, and its per-epoch order."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_megatron.data import DataConfig, DataFormatError, PromptLoader, RLHFDataset, collate_prompts
from verl_megatron.data.dataset import DataOrderMismatchError, check_data_files
from verl_megatron.data.sft_dataset import SFTItem, SFTLoader
from verl_megatron.utils.local_assets import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"), alphabet="0123456789")


def _row(i: int, extra_info) -> dict:
    return {
        "data_source": "synthetic/copy",
        "prompt": [{"role": "user", "content": str(i % 10)}],
        "reward_model": {"ground_truth": "1"},
        "extra_info": extra_info,
    }


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _dataset(tokenizer, path, n: int) -> RLHFDataset:
    return RLHFDataset(_jsonl(path, [_row(i, {"index": i}) for i in range(n)]), tokenizer, DataConfig())


def _rows(batch) -> list[int]:
    return [int(i) for i in batch.non_tensor_batch["index"]]


def test_a_missing_or_string_index_is_the_row_number_or_kept(tmp_path, tokenizer):
    # A parquet struct column fills the key a row lacks with None: {'index': None}.
    parquet = str(tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist([_row(0, {"index": 5}), _row(1, {"split": "train"})]), parquet)
    assert pq.read_table(parquet).to_pylist()[1]["extra_info"] == {"index": None, "split": "train"}
    rows = [
        _row(0, {"index": 0}),
        _row(1, {"index": None}),
        _row(2, {"index": "q7"}),
        _row(3, {"index": float("nan")}),
    ]
    jsonl = _jsonl(tmp_path / "d.jsonl", rows)
    assert check_data_files([parquet, jsonl], DataConfig()) == 6
    data = RLHFDataset([parquet, jsonl], tokenizer, DataConfig())
    index = collate_prompts(data.items, 0, 8).non_tensor_batch["index"]
    assert index.tolist() == [5, 1, 0, 1, "q7", 3]
    # The async trainer's check that the rollout drew the trainer's prompts (np.array_equal).
    assert np.array_equal(np.repeat(index, 2), np.repeat(index.copy(), 2))
    assert data.items[1].extra_info == {"index": None, "split": "train"}  # the row's own field, as given


def test_an_index_that_is_neither_a_number_nor_a_string_is_refused_naming_the_row(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [_row(0, {"index": 0}), _row(1, {"index": [1, 2]})])
    with pytest.raises(DataFormatError) as err:
        check_data_files([path], DataConfig())
    message = str(err.value)
    assert f"{path}: row 1" in message and "'extra_info.index'" in message and "\n" not in message


def test_a_resume_with_another_batch_size_goes_on_from_the_same_prompt(tmp_path, tokenizer):
    data = _dataset(tokenizer, tmp_path / "d.jsonl", 24)
    order = [np.random.default_rng([1, e]).permutation(24).tolist() for e in (0, 1)]
    saved = PromptLoader(data, 4, shuffle=True, seed=1, pad_token_id=0)
    assert [_rows(saved.next_batch()) for _ in range(3)] == [order[0][i : i + 4] for i in (0, 4, 8)]
    state = saved.state_dict()
    assert (state["rows_in_epoch"], state["num_rows"]) == (12, 24)
    resumed = PromptLoader(data, 8, shuffle=True, seed=1, pad_token_id=0)
    resumed.load_state_dict(state)
    assert _rows(resumed.next_batch()) == order[0][12:20]  # not rows 24.. (batch 3 of size 8)
    # 4 rows are left, fewer than a batch: dropped, as an uninterrupted run of size 8 would.
    assert _rows(resumed.next_batch()) == order[1][:8] and resumed.epoch == 1


def test_a_checkpoint_without_rows_in_epoch_resumes_in_batches_as_before(tmp_path, tokenizer):
    data = _dataset(tokenizer, tmp_path / "d.jsonl", 24)
    order = np.random.default_rng([1, 2]).permutation(24).tolist()
    loader = PromptLoader(data, 4, shuffle=True, seed=1, pad_token_id=0)
    loader.load_state_dict({"epoch": 2, "batch_in_epoch": 3, "seed": 1})
    assert _rows(loader.next_batch()) == order[12:16] and loader.state_dict()["batch_in_epoch"] == 4


def test_a_resume_over_a_dataset_of_another_length_is_refused(tmp_path, tokenizer):
    state = PromptLoader(
        _dataset(tokenizer, tmp_path / "a.jsonl", 24), 4, shuffle=True, seed=1, pad_token_id=0
    )
    other = PromptLoader(
        _dataset(tokenizer, tmp_path / "b.jsonl", 20), 4, shuffle=True, seed=1, pad_token_id=0
    )
    with pytest.raises(DataOrderMismatchError, match=r"over 24 prompts, this run's dataset has 20"):
        other.load_state_dict(state.state_dict())


class _Chats:
    """SFT items whose first token is their row number + 1."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> SFTItem:
        return SFTItem(input_ids=[i + 1, 1], loss_mask=[0, 1])


def test_sft_loader_resumes_by_rows_and_keeps_each_epochs_order():
    order = np.random.default_rng([3, 0]).permutation(10).tolist()
    saved = SFTLoader(_Chats(), 2, shuffle=True, seed=3, pad_token_id=0)
    first = saved._order(0)
    saved.next_batch()
    assert saved._order(0) is first  # drawn once per epoch, not per batch
    saved.next_batch()
    resumed = SFTLoader(_Chats(), 3, shuffle=True, seed=3, pad_token_id=0)
    resumed.load_state_dict(saved.state_dict())
    batch = resumed.next_batch()
    assert (batch.batch["input_ids"][:, 0] - 1).tolist() == order[4:7]


def test_the_cached_order_is_each_epochs_seeded_permutation(tmp_path, tokenizer):
    data = _dataset(tokenizer, tmp_path / "d.jsonl", 10)
    loader = PromptLoader(data, 5, shuffle=True, seed=7, pad_token_id=0)
    drawn = [_rows(loader.next_batch()) for _ in range(6)]
    expected = [np.random.default_rng([7, e]).permutation(10).tolist() for e in range(3)]
    assert drawn == [expected[e][i : i + 5] for e in range(3) for i in (0, 5)]
    assert loader._order(2) is loader._order(2) and loader._order(1).tolist() == expected[1]
