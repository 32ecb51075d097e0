"""Convert GSM8K-style jsonl (``{"question", "answer"}``, answer ending in ``#### 72``) to verl rows.

    python -m verl_megatron.data.gsm8k_format --in train.jsonl --out data/gsm8k

writes ``data/gsm8k/<split>.parquet`` (split: ``--split``, else ``train`` or
``test`` guessed from the input file name) with ``data_source``
``openai/gsm8k``, the question plus verl's step-by-step instruction as the user
message, and the number after ``####`` (commas removed) as ground truth.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from verl_megatron.data.dataset import DataFormatError, read_rows
from verl_megatron.data.synthetic import write_parquet

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_SOLUTION = re.compile(r"#### (\-?[0-9\.\,]+)")

__all__ = ["INSTRUCTION", "convert_rows", "extract_solution"]


def extract_solution(answer: str) -> str | None:
    """The final number of a GSM8K answer (``#### 1,234`` -> ``1234``), or None."""
    match = _SOLUTION.search(answer)
    return match.group(1).replace(",", "") if match else None


def convert_rows(rows: list[dict[str, Any]], split: str, source: str = "<input>") -> list[dict[str, Any]]:
    """verl rows for GSM8K records; a record without question/answer/#### fails naming its row."""
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
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


def _guess_split(path: str) -> str:
    name = os.path.basename(path).lower()
    return "test" if "test" in name else "train"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in", dest="inp", required=True, help="GSM8K-style .jsonl (or .parquet) file")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", default=None, help="split name (default: from the input file name)")
    args = parser.parse_args(argv)
    split = args.split or _guess_split(args.inp)
    rows = convert_rows(read_rows(args.inp), split, source=args.inp)
    path = os.path.join(args.out, f"{split}.parquet")
    write_parquet(rows, path)
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
