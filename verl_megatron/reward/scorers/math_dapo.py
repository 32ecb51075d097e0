"""DAPO / AIME scorer: the answer is given as ``Answer: X`` on its own line;
the reward is +1 for a correct answer and -1 otherwise (as in DAPO)."""

from __future__ import annotations

import re
from typing import Any

# The last "Answer:" in the response counts; DAPO asks for it on the last line.
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# MATH-500's longest answer is well under 300 characters; scanning only the
# tail keeps degenerate responses cheap.
_SOLUTION_CLIP_CHARS = 300
_INVALID = "[INVALID]"

# Words and LaTeX fragments that decorate an answer without changing it.
_UNIT_WORDS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
)  # fmt: skip
_DECORATIONS = (
    "\\ldots", "\\dots", "\\text{s}", "\\text{.}", "\\text{}^2", "\\text{}^3", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
)  # fmt: skip


def normalize_answer(answer: str) -> str:
    """Canonical string form of a final answer, so that ``$1,000$ dollars``,
    ``1000`` and ``x = 1000`` compare equal."""
    answer = answer.split("=")[-1]
    answer = answer.replace("\\$", "").replace("\\ ", "").replace("mbox", "text")
    answer = re.sub(r"^(an?) ", "", answer.strip())
    answer = answer.replace(" ", "")
    for word in _UNIT_WORDS:
        answer = answer.replace(word, "")
    for fragment in _DECORATIONS:
        answer = answer.replace(fragment, "")
    # Unwrap \text{..}, \textbf{..}, \overline{..}, \boxed{..} (innermost content kept).
    answer = re.sub(r"\\(?:text|textbf|overline)\{(.*?)\}", r"\1", answer)
    answer = re.sub(r"\\boxed\{(.*)\}", r"\1", answer)
    # Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
    answer = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", answer)
    answer = re.sub(r"sqrt([^{])", r"sqrt{\1}", answer)
    answer = answer.replace("$", "").rstrip(".")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(solution_str: str) -> str:
    """Normalised text after the last ``Answer:``, or ``[INVALID]``."""
    matches = _ANSWER_LINE.findall(solution_str[-_SOLUTION_CLIP_CHARS:])
    if not matches:
        return _INVALID
    return normalize_answer(matches[-1])


def compute_score(solution_str: str, ground_truth: str) -> dict[str, Any]:
    """``{"score": +1.0 or -1.0, "acc": bool, "pred": str}``."""
    pred = extract_answer(solution_str)
    correct = pred != _INVALID and pred == normalize_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
