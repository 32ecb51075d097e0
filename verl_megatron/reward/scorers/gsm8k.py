"""GSM8K scorer: the answer follows ``####`` at the end of the solution."""

from __future__ import annotations

import re

# Only the tail of a long solution can hold the final answer; scanning the
# whole text with regexes costs time on long (possibly degenerate) responses.
_SOLUTION_CLIP_CHARS = 300

_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """Pull the final numeric answer out of a GSM8K-style solution.

    ``strict`` requires the ``#### <number>`` format (so the format is also
    graded); ``flexible`` takes the last number-looking token anywhere.
    Thousands separators and dollar signs are dropped. Returns None when no
    answer is found.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k.extract_solution: method must be 'strict' or 'flexible', got {method!r}")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]
    if method == "strict":
        matches = _STRICT_ANSWER.findall(solution_str)
        if not matches:
            return None
        return matches[-1].replace(",", "").replace("$", "")
    for candidate in reversed(_ANY_NUMBER.findall(solution_str)):
        if candidate not in ("", "."):
            return candidate.replace(",", "").replace("$", "")
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong one that is
    well formatted, 0 when no answer could be extracted."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score
