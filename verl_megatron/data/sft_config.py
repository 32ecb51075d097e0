"""The ``sft`` section of the config: how supervised fine-tuning rows become token sequences."""

from __future__ import annotations

from dataclasses import dataclass

from verl_megatron.errors import ConfigError

__all__ = ["SFT_TRUNCATION_MODES", "SFTConfig"]

SFT_TRUNCATION_MODES = ("error", "right")


@dataclass
class SFTConfig:
    """Supervised fine-tuning data (used when ``trainer.mode: sft``; files are ``data.train_files``
    and ``data.val_files``, rows per step ``data.train_batch_size``).

    A row is verl's SFT format: either a chat in ``messages_key`` (a list of ``{"role",
    "content"}``; every assistant turn is trained on) or a ``prompt_key`` (a string, or a list of
    chat messages: context, assistant turns included, never trained on) with a ``response_key``
    string (the assistant's answer, the only part trained on). The
    model's chat template writes the conversation; only the tokens of assistant turns count in
    the loss.
    """

    messages_key: str = "messages"
    """Column of the chat (multi-turn rows)."""
    prompt_key: str = "prompt"
    """Column of the prompt, for rows without ``messages_key``."""
    response_key: str = "response"
    """Column of the response, for rows without ``messages_key``."""
    max_length: int = 1024
    """Longest templated conversation in tokens."""
    truncation: str = "error"
    """A longer conversation: "error" stops at start-up naming the file and row, "right" cuts its end."""

    def __post_init__(self) -> None:
        if self.truncation not in SFT_TRUNCATION_MODES:
            raise ConfigError(f"sft.truncation={self.truncation!r}; expected one of {SFT_TRUNCATION_MODES}")
        if self.max_length < 2:
            raise ConfigError(
                f"sft.max_length must be >= 2 (a token and its successor), got {self.max_length}"
            )
