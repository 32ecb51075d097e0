"""SFT rows for the synthetic quickstart task: each prompt with its correct answer as the response.

``sft_rows_from_rl`` turns the task's verl RL rows (``data/synthetic.py``: the prompt and the
answer as ground truth) into prompt/response rows, so SFT and GRPO see the same train/val split.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from verl_megatron.data.dataset import read_rows
from verl_megatron.data.synthetic import write_parquet

__all__ = ["sft_rows_from_rl", "write_sft_from_rl"]


def sft_rows_from_rl(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompt/response SFT rows: the RL row's chat prompt and its ground truth as the answer."""
    return [
        {
            "data_source": row["data_source"],
            "prompt": list(row["prompt"]),
            "response": str(row["reward_model"]["ground_truth"]),
        }
        for row in rows
    ]


def write_sft_from_rl(
    rl_paths: list[str],
    out_dir: str,
    convert: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = sft_rows_from_rl,
) -> list[str]:
    """The SFT version (``convert``) of each RL parquet file, written to ``out_dir`` under the same name."""
    written = []
    for path in rl_paths:
        out = os.path.join(out_dir, os.path.basename(path))
        write_parquet(convert(read_rows(path)), out)
        written.append(out)
    return written
