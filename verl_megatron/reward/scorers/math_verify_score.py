"""MATH-style scorer: the final answer is the last ``\\boxed{...}`` in the
solution, checked for mathematical equivalence with math-verify."""

from __future__ import annotations

import threading

# Limit the text handed to the LaTeX parser: the boxed answer sits at the end,
# and parsing a whole degenerate 8k-token response can take seconds.
_SOLUTION_CLIP_CHARS = 1000

# math-verify's own time limits (seconds) use SIGALRM, which only the main
# thread of a process may install. Elsewhere we turn them off; a hard stop is
# then the reward manager's job (`compute_score_timeout`, a killable process).
_PARSE_TIMEOUT_S = 5
_VERIFY_TIMEOUT_S = 5


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced
    braces, or None when there is none or it is not closed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_brace = text.index("{", start)
    depth = 0
    for pos in range(open_brace, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : pos]
    return None


def _signal_timeouts_allowed() -> bool:
    return threading.current_thread() is threading.main_thread()


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the solution's last boxed answer equals ``ground_truth``
    mathematically (``0.5 == \\frac{1}{2}``), else 0.0.

    Safe to call from worker processes and from threads: math-verify's
    SIGALRM-based time limits are only used on a main thread.
    """
    # Imported lazily: sympy + latex2sympy add ~0.3 s to start-up, which
    # scorers that never see a MATH sample should not pay.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    boxed = last_boxed_content(solution_str[-_SOLUTION_CLIP_CHARS:])
    if boxed is None:
        return 0.0
    on_main = _signal_timeouts_allowed()
    parse_timeout = _PARSE_TIMEOUT_S if on_main else None
    latex_only = [LatexExtractionConfig()]
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=latex_only, parsing_timeout=parse_timeout)
    pred = parse(
        f"\\boxed{{{boxed}}}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=parse_timeout,
    )
    if not gold or not pred:
        return 0.0
    correct = verify(gold, pred, timeout_seconds=_VERIFY_TIMEOUT_S if on_main else None)
    return 1.0 if correct else 0.0
