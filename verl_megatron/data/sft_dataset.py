"""Supervised fine-tuning rows -> token sequences with a loss mask on the assistant's tokens.

A row is a chat (``sft.messages_key``) or a prompt and a response (``sft.prompt_key``,
``sft.response_key``; see ``SFTConfig``). The model's chat template writes the conversation one
message at a time: the text each message adds is tokenized on its own, and the tokens an
assistant message adds (after the template's generation prompt) are the trained ones, so every
assistant turn of a multi-turn chat is trained on. A prompt/response row trains on its response
alone: assistant turns inside a list-valued prompt are context (verl's prompt/response SFT masks
the whole prompt). A template that rewrites earlier messages
when later ones are added cannot be split this way and is a ``DataFormatError`` naming the row.

``collate_sft`` lays a batch out as the actor's rows: a one-token "prompt" (the first token)
and the rest as the right-padded "response", with ``response_mask`` 1 where a token is trained
on, so the actor's log-probs, packing, micro-batching and loss aggregation apply unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl_megatron.data.config import DataConfig
from verl_megatron.data.dataset import (
    DataFormatError,
    PromptLoader,
    check_chat_messages,
    read_rows,
    require_chat_template,
)
from verl_megatron.data.sft_config import SFTConfig
from verl_megatron.protocol import DataProto

__all__ = ["SFTDataset", "SFTItem", "SFTLoader", "check_sft_files", "collate_sft", "sft_messages"]


@dataclass
class SFTItem:
    """One tokenized conversation: ``input_ids`` [L] and ``loss_mask`` [L] (1: an assistant token)."""

    input_ids: list[int]
    loss_mask: list[int]


def sft_messages(row: Any, where: str, config: SFTConfig, image_key: str) -> tuple[list[dict[str, str]], int]:
    """The row's chat and the index of its first message that may be trained on (0 for a chat,
    the response's for a prompt/response row), checked: at least one assistant message, no images
    (``image_key``, the run's ``data.image_key``); DataFormatError naming ``where``."""
    if not isinstance(row, dict):
        raise DataFormatError(f"{where}: a row must be an object, got {type(row).__name__}")
    _refuse_images(row, where, image_key)
    if row.get(config.messages_key) is not None:
        messages = check_chat_messages(row[config.messages_key], where, config.messages_key)
        first_trained = 0
    elif row.get(config.prompt_key) is not None and row.get(config.response_key) is not None:
        prompt, response = row[config.prompt_key], row[config.response_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = check_chat_messages(prompt, where, config.prompt_key)
        if not isinstance(response, str):
            raise DataFormatError(
                f"{where}: field '{config.response_key}' must be a string, got {type(response).__name__}"
            )
        first_trained = len(messages)  # the prompt is context, its assistant turns included
        messages.append({"role": "assistant", "content": response})
    else:
        raise DataFormatError(
            f"{where}: needs field '{config.messages_key}' (a chat) or fields '{config.prompt_key}' and "
            f"'{config.response_key}' (row has {sorted(row)})"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError(f"{where}: the chat has no assistant message, so nothing to train on")
    return messages, first_trained


def _refuse_images(row: dict[str, Any], where: str, image_key: str) -> None:
    # SFT tokenizes text only: a row's images would be dropped and the model trained on the
    # literal "<image>" placeholder with no pixels behind it.
    images = row.get(image_key)
    if images is not None and not (isinstance(images, list | tuple) and not images):
        raise DataFormatError(
            f"{where}: field '{image_key}' (data.image_key) holds images, but SFT trains on text only "
            "(multimodal SFT is not supported yet); remove the images from the SFT rows"
        )


def check_sft_files(files: Sequence[str], config: SFTConfig, image_key: str) -> int:
    """Read and check every row of ``files`` (no tokenizer; ``image_key``: ``data.image_key``);
    the number of rows."""
    rows = [(path, row) for path in files for row in enumerate(read_rows(path))]
    for path, (row_no, row) in rows:
        sft_messages(row, f"{path}: row {row_no}", config, image_key)
    return len(rows)


class SFTDataset:
    """Every row of ``data_files``, templated and tokenized up front (errors name file and row)."""

    def __init__(
        self, data_files: Sequence[str], tokenizer: Any, config: SFTConfig, data: DataConfig
    ) -> None:
        require_chat_template(tokenizer, data)
        self.config, self.tokenizer = config, tokenizer
        self.template_kwargs = dict(data.apply_chat_template_kwargs)
        self.items: list[SFTItem] = []
        self.num_truncated = 0
        for path in data_files:
            for row_no, row in enumerate(read_rows(os.fspath(path))):
                where = f"{path}: row {row_no}"
                messages, first_trained = sft_messages(row, where, config, data.image_key)
                self.items.append(self._item(messages, first_trained, where))
        if not self.items:
            raise DataFormatError(f"no SFT rows in {list(data_files)}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> SFTItem:
        return self.items[index]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def _pieces(
        self, messages: list[dict[str, str]], first_trained: int, where: str
    ) -> list[tuple[str, int]]:
        """(text, trained) pieces whose concatenation is the whole templated chat; the assistant
        messages from index ``first_trained`` on are the trained ones."""
        pieces: list[tuple[str, int]] = []
        done = ""
        for i, message in enumerate(messages):
            assistant = message["role"] == "assistant"
            steps = [(self._render(messages[:i], True), 0)] if assistant else []
            steps.append((self._render(messages[: i + 1], False), int(assistant and i >= first_trained)))
            for text, trained in steps:
                if not text.startswith(done):
                    raise DataFormatError(
                        f"{where}: the chat template rewrites earlier text when message {i} "
                        f"({message['role']}) is added, so the assistant's tokens cannot be told apart"
                    )
                pieces.append((text[len(done) :], trained))
                done = text
        return pieces

    def _item(self, messages: list[dict[str, str]], first_trained: int, where: str) -> SFTItem:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in self._pieces(messages, first_trained, where):
            piece = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids.extend(piece)
            mask.extend([trained] * len(piece))
        limit = self.config.max_length
        if len(ids) > limit:
            if self.config.truncation == "error":
                raise DataFormatError(
                    f"{where}: {len(ids)} tokens after the chat template > sft.max_length={limit} "
                    "(sft.truncation=error; raise sft.max_length or set sft.truncation=right)"
                )
            ids, mask = ids[:limit], mask[:limit]
            self.num_truncated += 1
        if not any(mask[1:]):
            raise DataFormatError(
                f"{where}: no assistant token left to train on (after sft.max_length={limit})"
            )
        return SFTItem(input_ids=ids, loss_mask=mask)


def collate_sft(items: Sequence[SFTItem], pad_token_id: int) -> DataProto:
    """The actor's row layout of a batch: ``input_ids``/``attention_mask`` [B, L] (right-padded to
    the longest), ``responses``/``response_mask`` [B, L-1] (token t+1 and whether it is trained)."""
    if not items:
        raise ValueError("collate_sft: empty batch")
    width = max(len(item.input_ids) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    loss_mask = torch.zeros((len(items), width), dtype=torch.float32)
    for i, item in enumerate(items):
        n = len(item.input_ids)
        input_ids[i, :n] = torch.tensor(item.input_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(item.loss_mask, dtype=torch.float32)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": input_ids[:, 1:].clone(),
        "response_mask": loss_mask[:, 1:].clone(),
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


class SFTLoader(PromptLoader):
    """``PromptLoader``'s seeded, resumable order over an :class:`SFTDataset`, batches by ``collate_sft``."""

    def next_batch(self) -> DataProto:
        return collate_sft([self.dataset[i] for i in self._next_rows().tolist()], self.pad_token_id)
