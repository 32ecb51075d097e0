"""The ``data`` section of the trainer config (verl's field names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRUNCATION_MODES = ("error", "left", "right", "middle")


@dataclass
class DataConfig:
    """Where prompts come from and how they are turned into a batch.

    Attributes:
        train_files: parquet or jsonl file(s) of verl rows for training (a single path is
            accepted in YAML and on the command line).
        val_files: parquet or jsonl file(s) of verl rows for validation.
        prompt_key: column holding the chat messages (a list of ``{"role", "content"}``).
        reward_fn_key: column naming the data source (selects the reward rule).
        max_prompt_length: longest prompt in tokens after the chat template.
        max_response_length: longest response in tokens (the rollout's ``response_length``).
        train_batch_size: prompts per training step (before ``rollout.n`` samples each).
        gen_batch_size: prompts per generation round with DAPO dynamic sampling
            (``algorithm.filter_groups``); None means ``train_batch_size``.
        val_batch_size: prompts per validation generation call; None means the whole set at once.
        return_raw_chat: keep the chat messages as ``raw_prompt`` in the batch.
        shuffle: shuffle the training set each epoch (seeded by ``seed`` and the epoch).
        validation_shuffle: shuffle the validation set (once, seeded).
        seed: seed of the shuffling; None means ``trainer.seed``.
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` at load
            time (the count is logged); when False such a prompt is handled by ``truncation``.
        truncation: what to do with an over-long prompt that was not filtered:
            "error" (raise naming the file and row), "left"/"right"/"middle" (cut tokens).
        apply_chat_template_kwargs: extra keyword arguments for ``tokenizer.apply_chat_template``.
        image_key: column holding a row's images (verl's ``data.image_key``); each ``<image>`` in
            the prompt stands for the next one (see ``data/multimodal.py``).
        max_image_pixels: images with more pixels (width x height) are refused at start-up, naming
            the row (the image processor resizes every image to its own pixel budget anyway; this
            guards against huge or corrupt files). None: no limit.
    """

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    gen_batch_size: int | None = None
    val_batch_size: int | None = None
    return_raw_chat: bool = False
    shuffle: bool = True
    validation_shuffle: bool = False
    seed: int | None = None
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    image_key: str = "images"
    max_image_pixels: int | None = 4096 * 4096
