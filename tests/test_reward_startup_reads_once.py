"""Start-up reads each data file once: the reward check (unknown data sources, null ground
truths) reuses the reward columns the data check gathered while reading the rows."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import verl_megatron.data.dataset as dataset
from verl_megatron.data.dataset import DataFormatError
from verl_megatron.errors import ConfigError
from verl_megatron.reward.loading import check_default_scorer_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(sources: list[str], truths: list[str | None]) -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"ground_truth": truth},
        }
        for i, (source, truth) in enumerate(zip(sources, truths, strict=True))
    ]


def _files(tmp_path, train: list[dict], val: list[dict]) -> tuple[str, str]:
    train_path, val_path = str(tmp_path / "train.parquet"), str(tmp_path / "val.jsonl")
    pq.write_table(pa.Table.from_pylist(train), train_path)
    with open(val_path, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(row) for row in val))
    return train_path, val_path


class _Stop(Exception):
    """Raised by the check after the reward check: start-up went far enough."""


def _stop(config) -> None:
    raise _Stop


def _count_reads(monkeypatch, paths: tuple[str, str]) -> dict[str, int]:
    """Counts each read of the two data files: parquet by pyarrow, JSON lines by read_rows."""
    reads = dict.fromkeys(paths, 0)
    read_table, read_rows = pq.read_table, dataset.read_rows

    def counted_table(source, *args, **kwargs):
        reads[str(source)] = reads.get(str(source), 0) + 1
        return read_table(source, *args, **kwargs)

    def counted_rows(path):
        if str(path).endswith(".jsonl"):
            reads[str(path)] = reads.get(str(path), 0) + 1
        return read_rows(path)

    monkeypatch.setattr(pq, "read_table", counted_table)
    monkeypatch.setattr(dataset, "read_rows", counted_rows)
    return reads


def _start(train_path: str, val_path: str) -> None:
    """The training entry point up to (and with) the start-up checks, no further."""
    from verl_megatron import train

    overrides = [
        f"data.train_files=[{train_path}]",
        f"data.val_files=[{val_path}]",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4",
    ]
    with pytest.raises(_Stop):
        train.run(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)


def test_start_up_reads_each_data_file_once(tmp_path, monkeypatch):
    import verl_megatron.trainer.distill_checks as distill_checks

    paths = _files(
        tmp_path, _rows(["synthetic/copy"] * 4, ["1"] * 4), _rows(["synthetic/copy"] * 2, ["2"] * 2)
    )
    reads = _count_reads(monkeypatch, paths)
    monkeypatch.setattr(distill_checks, "check_distill", _stop)
    _start(*paths)
    assert reads == dict.fromkeys(paths, 1), reads


def test_start_up_refuses_from_the_gathered_columns(tmp_path, monkeypatch):
    train_rows = _rows(["synthetic/copy", "synthetic/copy", "my_task", "synthetic/copy"], ["1"] * 4)
    paths = _files(tmp_path, train_rows, _rows(["synthetic/copy"] * 2, ["2"] * 2))
    reads = _count_reads(monkeypatch, paths)
    with pytest.raises(ConfigError, match=r"train\.parquet: row 2: data_source='my_task' has no rule"):
        _start(*paths)
    assert reads == dict.fromkeys(paths, 1), reads


@pytest.mark.parametrize(
    ("sources", "truths", "error", "message"),
    [
        (["synthetic/copy", "my_task", "x"], ["1", "1", None], ConfigError, "row 1: data_source='my_task'"),
        (["synthetic/copy", "synthetic/copy", "x"], ["1", None, "1"], DataFormatError, "row 1: reward_model"),
        (["synthetic/copy", "my_task", "x"], ["1", None, "1"], ConfigError, "row 1: data_source='my_task'"),
    ],
)
def test_gathered_columns_refuse_the_row_a_file_read_refuses(tmp_path, sources, truths, error, message):
    """The first refused row, its data source before its ground truth, as a row-by-row read."""
    from verl_megatron.reward.loading import RewardColumns

    train_path, _ = _files(tmp_path, _rows(sources, truths), [])
    config = {"data": {"train_files": [train_path]}}
    with pytest.raises(error) as read:
        check_default_scorer_data(config)  # no columns: reads the file
    columns = RewardColumns()
    dataset.check_data_files([train_path], dataset.DataConfig(), columns.add)
    with pytest.raises(error) as gathered:
        check_default_scorer_data(config, columns)
    assert str(gathered.value) == str(read.value)
    assert f"{train_path}: {message}" in str(read.value)
