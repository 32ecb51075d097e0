"""Convert GSM8K-style records (``{"question", "answer"}``, answer ending in ``#### 72``) to verl rows.

    python -m verl_megatron.data.gsm8k_format --in train.jsonl --split train --out data/gsm8k

reads JSON Lines, one JSON array (``.json``) or parquet (a UTF-8 byte-order mark is
fine) and writes ``data/gsm8k/<split>.parquet`` with ``data_source`` ``openai/gsm8k``,
the question plus verl's step-by-step instruction as the user message, and the number
after ``####`` (commas removed) as ground truth. The split is given, never guessed
from the file name.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from verl_megatron.data.dataset import DataFormatError, read_rows
from verl_megatron.data.synthetic import write_parquet
from verl_megatron.errors import UserInputError, report_user_error

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")

__all__ = ["INSTRUCTION", "SPLITS", "convert_rows", "extract_solution", "main"]


def extract_solution(answer: str) -> str | None:
    """The final number of a GSM8K answer (``#### 1,234`` -> ``1234``), or None."""
    match = _SOLUTION.search(answer)
    return match.group(1).replace(",", "") if match else None


def convert_rows(rows: list[dict[str, Any]], split: str, source: str = "<input>") -> list[dict[str, Any]]:
    """verl rows for GSM8K records; a record without question/answer/#### fails naming its row."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}: a record must be an object, got {type(row).__name__}")
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataFormatError(f"{where}: needs string fields 'question' and 'answer' (has {sorted(row)})")
        solution = extract_solution(answer)
        if solution is None:
            raise DataFormatError(f"{where}: field 'answer' has no final '#### <number>'")
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution},
                "extra_info": {"split": split, "index": i, "answer": answer, "question": question},
            }
        )
    return out


SPLITS = ("train", "test")


def main(argv: list[str] | None = None) -> int:
    """Command line; a bad input file prints one ``error:`` line and returns 2."""
    parser = argparse.ArgumentParser(
        prog="python -m verl_megatron.data.gsm8k_format",
        description="Convert GSM8K-style records to verl rows (<out>/<split>.parquet).",
    )
    parser.add_argument("--in", dest="inp", required=True, help="GSM8K-style .jsonl, .json or .parquet file")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", required=True, choices=SPLITS, help="which split the input file is")
    args = parser.parse_args(argv)
    try:
        rows = convert_rows(read_rows(args.inp), args.split, source=args.inp)
    except UserInputError as err:
        return report_user_error(err)
    path = os.path.join(args.out, f"{args.split}.parquet")
    write_parquet(rows, path)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
