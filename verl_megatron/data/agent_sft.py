"""SFT rows for the lookup task: the whole tool-use conversation the agent harness would have.

Each RL row of ``data/lookup_task.py`` (a key as the user's message) becomes one chat::

    user: KEY -> assistant: <tool_call>KEY</tool_call> -> tool: VALUE -> assistant: VALUE

The assistant's tool call is written as its chat-template text (``bare`` format), which the
agent chat template renders exactly as it renders an assistant message with ``tool_calls``
(empty content), so SFT trains on the ids the endpoint samples for that turn; the SFT dataset
trains on the assistant turns only (the tool's reply and the role markers are masked out).
Same train / validation split as the RL rows: validation keys are never trained on.
"""

from __future__ import annotations

from typing import Any

from verl_megatron.data.synthetic_sft import write_sft_from_rl

__all__ = ["lookup_sft_rows", "write_lookup_sft_from_rl"]

# The ``bare`` tool-call markers (rollout/chat_format.py; data/ sits below rollout/ in the layers).
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


def lookup_sft_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One four-message chat per lookup RL row (see the module docstring)."""
    out = []
    for row in rows:
        key = str(row["extra_info"]["key"])
        value = str(row["reward_model"]["ground_truth"])
        out.append(
            {
                "data_source": row["data_source"],
                "messages": [
                    {"role": "user", "content": key},
                    {"role": "assistant", "content": f"{_CALL_OPEN}{key}{_CALL_CLOSE}"},
                    {"role": "tool", "content": value},
                    {"role": "assistant", "content": value},
                ],
            }
        )
    return out


def write_lookup_sft_from_rl(rl_paths: list[str], out_dir: str) -> list[str]:
    """The SFT chats of each lookup RL parquet file, written to ``out_dir`` under the same name."""
    return write_sft_from_rl(rl_paths, out_dir, convert=lookup_sft_rows)
