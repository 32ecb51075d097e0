"""Synthetic digit tasks for the quickstart: reverse or copy a string of digits.

The answer is made of the prompt's own tokens, so a tiny random-init model can
learn it with RL in minutes on a CPU (see the quickstart config). Every digit
string of the chosen length is enumerated once, shuffled with a seed, and a
fraction is held out for validation, so validation prompts are never trained on.

    python -m verl_megatron.data.synthetic --task reverse --out data/reverse

writes ``train.parquet`` and ``val.parquet`` in verl's row format with
``data_source`` ``synthetic/<task>`` and the expected digits as ground truth
(scored by ``verl_megatron.reward.scorers.synthetic``).
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any

import numpy as np

TASKS = ("reverse", "copy")

__all__ = ["TASKS", "make_rows", "write_parquet", "write_synthetic_dataset"]


def _answer(task: str, digits: str) -> str:
    if task == "reverse":
        return digits[::-1]
    if task == "copy":
        return digits
    raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")


def make_rows(task: str, strings: list[str], split: str) -> list[dict[str, Any]]:
    """verl rows for ``strings``: the prompt is the digits alone, the ground truth the answer."""
    return [
        {
            "data_source": f"synthetic/{task}",
            "prompt": [{"role": "user", "content": digits}],
            "ability": "synthetic",
            "reward_model": {"style": "rule", "ground_truth": _answer(task, digits)},
            "extra_info": {"split": split, "index": i},
        }
        for i, digits in enumerate(strings)
    ]


def write_parquet(rows: list[dict[str, Any]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_synthetic_dataset(
    out_dir: str | os.PathLike,
    task: str = "reverse",
    num_digits: int = 3,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` for ``task``; returns their paths.

    All ``10 ** num_digits`` strings are split ``1 - val_fraction`` / ``val_fraction``.
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")
    if not 1 <= num_digits <= 6:
        raise ValueError(f"num_digits must be in 1..6 (all strings are enumerated), got {num_digits}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    strings = ["".join(d) for d in itertools.product("0123456789", repeat=num_digits)]
    order = np.random.default_rng(seed).permutation(len(strings))
    num_val = max(1, round(len(strings) * val_fraction))
    val = [strings[i] for i in order[:num_val]]
    train = [strings[i] for i in order[num_val:]]
    out_dir = os.fspath(out_dir)
    train_path, val_path = os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "val.parquet")
    write_parquet(make_rows(task, train, "train"), train_path)
    write_parquet(make_rows(task, val, "val"), val_path)
    return train_path, val_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASKS, default="reverse")
    parser.add_argument("--out", required=True, help="output directory for train/val parquet files")
    parser.add_argument("--num-digits", type=int, default=3)
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, val = write_synthetic_dataset(args.out, args.task, args.num_digits, args.val_fraction, args.seed)
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
