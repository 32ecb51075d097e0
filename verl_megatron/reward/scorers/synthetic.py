"""Scorer for the quickstart's synthetic digit tasks (``synthetic/reverse``,
``synthetic/copy``): the ground truth is the expected digit string."""

from __future__ import annotations

import re

_DIGIT = re.compile(r"[0-9]")


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """Fraction of positions where the predicted digit matches, over the longer
    of the two strings.

    The prediction is every digit in the response, in order: a character-level
    tokenizer may decode with spaces between tokens, and those do not count.
    Dividing by ``max(len(gt), len(pred))`` makes extra digits cost reward, so
    the policy learns to stop. Example: gt "120", response "1 2 0 7" -> 3/4.
    """
    target = str(ground_truth)
    if not target or not target.isdigit():
        raise ValueError(
            f"synthetic scorer: ground_truth must be a non-empty digit string, got {ground_truth!r}"
        )
    pred = _DIGIT.findall(solution_str)
    matches = sum(p == t for p, t in zip(pred, target))
    return matches / max(len(target), len(pred))
