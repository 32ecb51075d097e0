"""Scorer for the vision-language quickstart's shapes task (``synthetic/shapes``,
``data/shapes_task.py``): the ground truth is the square's colour."""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z]+|[^\sa-z]")


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the answer is the colour alone, 0.5 when it starts with the colour but goes on,
    0.0 otherwise (another colour, other words, nothing). Case and surrounding spaces do not count.
    Example: gt "red": "red" -> 1.0, "Red " -> 1.0, "red red" -> 0.5, "blue" -> 0.0, "?" -> 0.0.
    The half credit for a right first word rewards reading the image before the policy has
    learned to stop (a word-level tokenizer decodes "red" + eos as "red")."""
    target = str(ground_truth).strip().lower()
    if not target.isalpha():
        raise ValueError(f"shapes scorer: ground_truth must be a colour word, got {ground_truth!r}")
    words = _WORD.findall(solution_str.lower())
    if not words or words[0] != target:
        return 0.0
    return 1.0 if len(words) == 1 else 0.5
