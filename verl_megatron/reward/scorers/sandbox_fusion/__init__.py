"""Code rewards from a SandboxFusion-style runner (verl's ``utils.reward_score.sandbox_fusion``):
the share of a problem's test cases the completion's program passes. The runner is a
SandboxFusion server or, with ``sandbox_fusion_url="local"``, this project's own sandbox
(see :mod:`.utils`)."""

from __future__ import annotations

import json
import logging
from typing import Any

from verl_megatron.reward.scorers.sandbox_fusion.utils import check_correctness

__all__ = ["check_correctness", "compute_score"]

logger = logging.getLogger(__name__)

# verl's continuous score looks at the first cases only.
CONTINUOUS_CASES = 10


def _solution(completion: str) -> str | None:
    """The code of the last ```python block, else of the first ``` block (a leading language
    name line dropped); None without a code block."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    parts = completion.split("```")
    if len(parts) < 2:
        return None
    code = parts[1]
    first, _, rest = code.partition("\n")
    return rest if rest and first.strip().isalpha() else code


def _test_cases(test_cases: Any) -> dict[str, Any] | None:
    """A dict with ``inputs`` and ``outputs`` (assert cases get empty stdin and no expected
    output), from a dict or its JSON; None when it is neither."""
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, ValueError):
            return None
    if not isinstance(test_cases, dict):
        return None
    if isinstance(test_cases.get("assert_case"), list):
        test_cases.setdefault("inputs", [""] * len(test_cases["assert_case"]))
        test_cases.setdefault("outputs", [None] * len(test_cases["assert_case"]))
    if "inputs" not in test_cases or "outputs" not in test_cases:
        return None
    return test_cases


def compute_score(
    sandbox_fusion_url: str,
    concurrent_semaphore: Any,
    memory_limit_mb: int,
    completion: str,
    test_cases: Any,
    continuous: bool = False,
    timeout: int = 10,
) -> tuple[float, list[dict[str, Any]]]:
    """(share of cases passed, per-case metadata); with `continuous` the share of the first
    ``CONTINUOUS_CASES`` cases. 0.0 with an error entry for a completion without code or
    unreadable test cases."""
    solution = _solution(completion)
    if solution is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    cases = _test_cases(test_cases)
    if cases is None:
        return 0.0, [{"error": "Invalid test_cases (need JSON with inputs/outputs)"}]
    results, metadata = check_correctness(
        sandbox_fusion_url=sandbox_fusion_url,
        in_outs=cases,
        generation=solution,
        timeout=timeout,
        memory_limit_mb=memory_limit_mb,
        concurrent_semaphore=concurrent_semaphore,
    )
    considered = results[:CONTINUOUS_CASES] if continuous else results
    if not considered:
        return 0.0, metadata
    return sum(r is True for r in considered) / len(considered), metadata
