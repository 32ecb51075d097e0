"""Prompt datasets in verl's row format, and the seeded, resumable loader over them.

A row (one line of jsonl, or one parquet record) looks like::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

``RLHFDataset`` reads and checks every row up front (a malformed row fails
with the file, the row number and the field), applies the tokenizer's chat
template, and drops or cuts prompts longer than ``max_prompt_length``.
``collate_prompts`` turns a list of items into a ``DataProto`` with
left-padded ``input_ids``/``attention_mask``/``position_ids`` [B, Tp].
``PromptLoader`` yields batches in a seeded order and can resume mid-epoch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl_megatron.data.config import TRUNCATION_MODES, DataConfig
from verl_megatron.errors import UserInputError

# ``verl-megatron check`` reads the data files with this module before torchrun starts the ranks:
# the protocol (tensordict, torch._dynamo) loads where a batch is collated.
if TYPE_CHECKING:
    from verl_megatron.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = [
    "DataFileNotFoundError",
    "DataFormatError",
    "DataOrderMismatchError",
    "PromptLoader",
    "RLHFDataset",
    "check_data_files",
    "collate_prompts",
    "read_rows",
]


class DataFormatError(UserInputError):
    """A data file or row that does not follow verl's row format."""


class DataFileNotFoundError(DataFormatError, FileNotFoundError):
    """A data file that does not exist."""


class DataOrderMismatchError(UserInputError):
    """A resumed run whose data order was drawn with another seed than this run's."""


def _read_json_rows(path: str) -> list[Any]:
    """JSON Lines, or one JSON array of rows (``.json``); a UTF-8 byte-order mark is skipped."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise DataFormatError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}: not a valid JSON array (line {err.lineno}: {err.msg})") from None
        return rows
    rows = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataFormatError(f"{path}: line {line_no} is not valid JSON ({err})") from None
    return rows


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``.parquet``, ``.jsonl`` or ``.json`` (JSON Lines or one array) file, in file order.

    Raises DataFileNotFoundError or DataFormatError naming the file (and line) for a missing,
    unreadable or empty file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataFileNotFoundError(f"data file '{path}' does not exist")
    if os.path.isdir(path):
        raise DataFormatError(
            f"data file '{path}' is a directory; list its files, e.g. data.train_files=[{path}/train.parquet]"
        )
    if path.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pyarrow.ArrowException, OSError) as err:
            raise DataFormatError(f"data file '{path}' is not a readable parquet file ({err})") from None
    elif path.endswith((".jsonl", ".json")):
        rows = _read_json_rows(path)
    else:
        raise DataFormatError(f"data file '{path}': unsupported extension (use .parquet, .jsonl or .json)")
    if not rows:
        raise DataFormatError(f"data file '{path}' has no rows")
    return rows


def check_data_files(
    files: Sequence[str], config: DataConfig, on_row: Callable[[str, int, dict[str, Any]], None] | None = None
) -> int:
    """Read and check every row of ``files`` (no tokenizer); return the number of rows.

    Cheap enough for the launching process: it finds a missing file or a malformed
    row before any worker starts. Rows with images (``config.image_key``) have every image
    decoded and checked (``data/multimodal.py``; relative paths are under the data file's folder).
    ``on_row(path, row_no, fields)`` sees each checked row's fields (the start-up reward check
    gathers its columns there rather than read the files again).
    """
    total = 0
    for path in files:
        for row_no, row in enumerate(read_rows(path)):
            fields = _check_row(row, f"{path}: row {row_no}", config)
            if on_row is not None:
                on_row(path, row_no, fields)
            if isinstance(row, dict) and row.get(config.image_key) is not None:
                _check_images(row, f"{path}: row {row_no}", config, os.path.dirname(os.path.abspath(path)))
            total += 1
    return total


def _check_images(row: dict[str, Any], where: str, config: DataConfig, base_dir: str) -> None:
    """Every image of a multimodal row decodes, fits ``data.max_image_pixels`` and has its ``<image>``."""
    from verl_megatron.data.multimodal import check_multimodal_row

    check_multimodal_row(
        row, where, prompt_key=config.prompt_key, image_key=config.image_key,
        max_pixels=config.max_image_pixels, base_dir=base_dir,
    )  # fmt: skip


@dataclass
class PromptItem:
    """One checked, tokenized prompt: ``input_ids`` [Tp] (unpadded) and the row's other fields."""

    input_ids: list[int]
    data_source: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    ability: str
    raw_prompt: list[dict[str, str]]
    index: int | float | str  # extra_info.index as given, else the row number in its file
    # A row with images (data/multimodal.encode_image_row): the images kept encoded (pixel values
    # are made per batch by collate_prompts), their patch grids [n, 3] and its 3-D ids [3, Tp].
    images: tuple[bytes, ...] | None = None
    image_grid_thw: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None


def _check_messages(messages: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(messages, (list, tuple, np.ndarray)) or len(messages) == 0:
        raise DataFormatError(
            f"{where}: field '{key}' must be a non-empty list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {type(messages).__name__}"
        )
    checked = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataFormatError(
                f"{where}: field '{key}[{i}]' must be a dict with string 'role' and 'content', got {message!r}"
            )
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def _check_row(row: Any, where: str, config: DataConfig) -> dict[str, Any]:
    """The row's fields, checked; raises DataFormatError naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: a row must be an object, got {type(row).__name__}")
    for key in (config.prompt_key, config.reward_fn_key, "reward_model"):
        if key not in row or row[key] is None:
            raise DataFormatError(f"{where}: missing field '{key}' (row has {sorted(row)})")
    messages = _check_messages(row[config.prompt_key], where, config.prompt_key)
    source = row[config.reward_fn_key]
    if not isinstance(source, str) or not source:
        raise DataFormatError(f"{where}: field '{config.reward_fn_key}' must be a non-empty string")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DataFormatError(
            f"{where}: field 'reward_model' must be a dict with a 'ground_truth', got {reward_model!r}"
        )
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataFormatError(f"{where}: field 'extra_info' must be a dict, got {type(extra_info).__name__}")
    ability = row.get("ability") or ""
    if not isinstance(ability, str):
        raise DataFormatError(f"{where}: field 'ability' must be a string, got {type(ability).__name__}")
    return {
        "messages": messages,
        "data_source": source,
        "reward_model": dict(reward_model),
        "extra_info": dict(extra_info),
        "ability": ability,
        "index": _check_index(extra_info.get("index"), where),
    }


def _check_index(index: Any, where: str) -> Any:
    """``extra_info.index`` as given (verl keeps it: an int, or a string such as 'q7'); None when it
    is missing, None (a parquet struct column fills a key a row lacks with None) or NaN (pandas'
    missing number), for the caller's row number. It names the prompt in samples.jsonl and in the
    async trainer's check that the rollout drew the trainer's prompts, which compares with ==."""
    if index is None or (isinstance(index, (float, np.floating)) and np.isnan(index)):
        return None
    numbers = (int, float, np.integer, np.floating)
    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (str, *numbers)):
        raise DataFormatError(
            f"{where}: field 'extra_info.index' must be an integer or a string, "
            f"got {type(index).__name__} {index!r}"
        )
    return index


def _check_chat_template(tokenizer: Any, config: DataConfig) -> None:
    """Prompts are chat messages: without a template there is no way to turn them into tokens."""
    if getattr(tokenizer, "chat_template", None) or config.apply_chat_template_kwargs.get("chat_template"):
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise DataFormatError(
        f"the tokenizer at '{name}' has no chat template (no chat_template.jinja, no 'chat_template' in "
        "tokenizer_config.json); use an instruct model's tokenizer (model.tokenizer_path) or give one "
        "with data.apply_chat_template_kwargs.chat_template='{% for m in messages %}...{% endfor %}'"
    )


# Public names for the SFT dataset (data/sft_dataset.py), which checks chats the same way.
check_chat_messages = _check_messages
require_chat_template = _check_chat_template


def _truncate(ids: list[int], max_len: int, mode: str) -> list[int]:
    if mode == "left":  # keep the end of the prompt, where the question usually is
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    head = max_len // 2  # "middle": keep both ends
    return ids[:head] + ids[len(ids) - (max_len - head) :]


class RLHFDataset:
    """Prompts from verl-format files, tokenized with the tokenizer's chat template.

    Over-long prompts (more than ``config.max_prompt_length`` tokens) are dropped
    when ``config.filter_overlong_prompts`` (``num_filtered`` counts them), else
    cut or rejected according to ``config.truncation``.
    """

    def __init__(
        self, data_files: str | Sequence[str], tokenizer: Any, config: DataConfig, processor: Any = None
    ) -> None:
        if config.truncation not in TRUNCATION_MODES:
            raise DataFormatError(
                f"data.truncation={config.truncation!r}; expected one of {TRUNCATION_MODES}"
            )
        files = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
        if not files:
            raise DataFormatError("RLHFDataset: no data files given")
        _check_chat_template(tokenizer, config)
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor  # data/multimodal.ImageTextProcessor: rows with images (else refused)
        self.items: list[PromptItem] = []
        self.num_filtered = 0
        self.num_truncated = 0
        for path in files:
            self._load_file(os.fspath(path))
        if not self.items:
            raise DataFormatError(
                f"no prompts left in {files} after filtering {self.num_filtered} prompt(s) "
                f"longer than data.max_prompt_length={config.max_prompt_length}"
            )
        if self.num_filtered:
            logger.warning(
                "filtered %d prompt(s) longer than data.max_prompt_length=%d from %s; %d remain",
                self.num_filtered,
                config.max_prompt_length,
                files,
                len(self.items),
            )

    def _tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.config.apply_chat_template_kwargs
        )
        # The template already placed every special token the model expects.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _load_file(self, path: str) -> None:
        max_len = self.config.max_prompt_length
        for row_no, row in enumerate(read_rows(path)):
            where = f"{path}: row {row_no}"
            fields = _check_row(row, where, self.config)
            image_row = self._encode_images(row, fields, where, path)
            ids = self._tokenize(fields["messages"]) if image_row is None else image_row.input_ids
            if len(ids) > max_len and image_row is not None and not self.config.filter_overlong_prompts:
                raise DataFormatError(
                    f"{where}: prompt with images has {len(ids)} tokens > data.max_prompt_length={max_len} "
                    "(image tokens cannot be cut); set data.filter_overlong_prompts=True"
                )
            if len(ids) > max_len:
                if self.config.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.config.truncation == "error":
                    raise DataFormatError(
                        f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={max_len}; "
                        "set data.filter_overlong_prompts=True or data.truncation=left|right|middle"
                    )
                ids = _truncate(ids, max_len, self.config.truncation)
                self.num_truncated += 1
            self.items.append(
                PromptItem(
                    input_ids=ids,
                    data_source=fields["data_source"],
                    reward_model=fields["reward_model"],
                    extra_info=fields["extra_info"],
                    ability=fields["ability"],
                    raw_prompt=fields["messages"],
                    index=row_no if fields["index"] is None else fields["index"],
                    images=None if image_row is None else image_row.images,
                    image_grid_thw=None if image_row is None else image_row.image_grid_thw,
                    mrope_positions=None if image_row is None else image_row.position_ids,
                )
            )

    def _encode_images(self, row: dict[str, Any], fields: dict[str, Any], where: str, path: str) -> Any:
        """``data/multimodal.EncodedImageRow`` of a row with images, None for a text row."""
        images = row.get(self.config.image_key)
        if images is None or len(images) == 0:
            return None
        if self.processor is None:
            raise DataFormatError(
                f"{where}: field '{self.config.image_key}' holds images but model.path has no image "
                "processor (preprocessor_config.json): images need a vision-language checkpoint"
            )
        from verl_megatron.data.multimodal import encode_image_row

        return encode_image_row(
            row, where, self.processor, messages=fields["messages"], prompt_key=self.config.prompt_key,
            image_key=self.config.image_key,
            max_pixels=self.config.max_image_pixels, base_dir=os.path.dirname(os.path.abspath(path)),
            chat_template_kwargs=self.config.apply_chat_template_kwargs,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def collate_prompts(
    items: Sequence[PromptItem],
    pad_token_id: int,
    max_prompt_length: int,
    return_raw_chat: bool = False,
    processor: Any = None,
) -> DataProto:
    """Left-pad prompts to ``max_prompt_length`` and batch them.

    Returns a DataProto with ``input_ids``, ``attention_mask``, ``position_ids``
    [B, max_prompt_length] and non-tensors ``data_source``, ``reward_model``,
    ``extra_info``, ``ability``, ``index`` (and ``raw_prompt`` when asked).
    A fixed width (verl's choice) lets batches from several generation rounds
    be concatenated. Items with images need ``processor`` (``data/multimodal.ImageTextProcessor``).
    """
    if not items:
        raise ValueError("collate_prompts: empty batch")
    B = len(items)
    input_ids = torch.full((B, max_prompt_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, max_prompt_length), dtype=torch.long)
    for i, item in enumerate(items):
        n = len(item.input_ids)
        if n > max_prompt_length:
            raise ValueError(
                f"collate_prompts: prompt {i} has {n} tokens > max_prompt_length={max_prompt_length}"
            )
        input_ids[i, max_prompt_length - n :] = torch.tensor(item.input_ids, dtype=torch.long)
        attention_mask[i, max_prompt_length - n :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    non_tensors = {
        "data_source": _object_array([item.data_source for item in items]),
        "reward_model": _object_array([item.reward_model for item in items]),
        "extra_info": _object_array([item.extra_info for item in items]),
        "ability": _object_array([item.ability for item in items]),
        "index": _object_array([item.index for item in items]),
    }
    if return_raw_chat:
        non_tensors["raw_prompt"] = _object_array([item.raw_prompt for item in items])
    if any(item.images for item in items):  # image rows: verl's VL prompt batch
        from verl_megatron.data.multimodal import batch_position_ids, multimodal_columns

        columns = multimodal_columns([(item.images, item.image_grid_thw) for item in items], processor)
        non_tensors.update({key: _object_array(values) for key, values in columns.items()})
        lengths = [len(item.input_ids) for item in items]
        position_ids = batch_position_ids(
            [item.mrope_positions for item in items], lengths, max_prompt_length
        )
    from verl_megatron.protocol import DataProto

    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors=non_tensors,
    )


class PromptLoader:
    """Batches of ``batch_size`` prompts, reshuffled each epoch with a seeded permutation.

    The order depends only on ``(seed, epoch)``, so every process of an SPMD job
    draws the same batches, and ``load_state_dict`` of a saved position replays
    exactly the prompts an uninterrupted run would have drawn next. The position is
    the number of rows drawn in the epoch, so a run resumed with another batch size
    goes on from the same prompt. An incomplete last batch of an epoch is dropped
    (as verl's ``drop_last``).
    """

    def __init__(
        self,
        dataset: RLHFDataset,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        pad_token_id: int,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"PromptLoader: batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DataFormatError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size} "
                "(data.train_batch_size)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.drop_last = drop_last
        self.epoch = 0
        self.rows_in_epoch = 0  # rows of this epoch's order drawn so far
        self._cached_order: tuple[tuple[int, int], np.ndarray] | None = None

    @property
    def batch_in_epoch(self) -> int:
        """Batches of this epoch drawn so far (a part-batch left by a resume counts as one)."""
        return -(-self.rows_in_epoch // self.batch_size)

    @batch_in_epoch.setter
    def batch_in_epoch(self, value: int) -> None:
        self.rows_in_epoch = min(value * self.batch_size, len(self.dataset))

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch``; drawn once per epoch (a permutation of 1M rows takes ~30 ms)."""
        key = (epoch, len(self.dataset))
        if self._cached_order is None or self._cached_order[0] != key:
            if not self.shuffle:
                order = np.arange(len(self.dataset))
            else:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._cached_order = (key, order)
        return self._cached_order[1]

    def _next_rows(self) -> np.ndarray:
        """The dataset rows of the next batch, moving to a new epoch (and a new order) when this one is used up."""
        left = len(self.dataset) - self.rows_in_epoch
        if left <= 0 or (self.drop_last and left < self.batch_size):
            self.epoch += 1
            self.rows_in_epoch = 0
        start = self.rows_in_epoch
        rows = self._order(self.epoch)[start : start + self.batch_size]
        self.rows_in_epoch += len(rows)
        return rows

    def next_batch(self) -> DataProto:
        """The next batch, moving to a new epoch (and a new order) when this one is used up."""
        config = self.dataset.config
        return collate_prompts(
            [self.dataset[int(i)] for i in self._next_rows()],
            self.pad_token_id,
            config.max_prompt_length,
            return_raw_chat=config.return_raw_chat,
            processor=self.dataset.processor,
        )

    def epoch_batches(self) -> Iterator[DataProto]:
        """Every batch of one pass, in order (used for validation)."""
        self.epoch, self.rows_in_epoch = 0, 0
        for _ in range(len(self)):
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "rows_in_epoch": self.rows_in_epoch,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; one saved before ``rows_in_epoch`` existed is taken in batches
        of this loader's size (as it was then). A dataset of another length is refused: its order
        is another permutation, so the drawn rows would not be the ones the saved run drew."""
        if int(state["seed"]) != self.seed:
            raise DataOrderMismatchError(
                f"the checkpoint's data order was drawn with seed {state['seed']}, this run uses {self.seed}; "
                "resume with the same data.seed/trainer.seed"
            )
        if "num_rows" in state and int(state["num_rows"]) != len(self.dataset):
            raise DataOrderMismatchError(
                f"the checkpoint's data order is over {state['num_rows']} prompts, this run's dataset has "
                f"{len(self.dataset)} (data files or filtering changed); resume with the same data"
            )
        self.epoch = int(state["epoch"])
        if "rows_in_epoch" in state:
            self.rows_in_epoch = int(state["rows_in_epoch"])
        else:
            self.batch_in_epoch = int(state["batch_in_epoch"])
