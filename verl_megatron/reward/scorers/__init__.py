"""Rule-based scorers and the default scorer that dispatches on ``data_source``.

A scorer is ``compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kwargs) -> float | dict``; a dict carries its reward under
``"score"`` and every other key is logged per sample.
"""

from __future__ import annotations

import functools
from typing import Any

from verl_megatron.reward.scorers import code_exec, gsm8k, math_dapo, math_verify_score, shapes, synthetic

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo",)
DAPO_SOURCE_PREFIXES = ("aime",)
SYNTHETIC_SOURCES = ("synthetic/reverse", "synthetic/copy")
SHAPES_SOURCES = ("synthetic/shapes",)  # the vision-language quickstart (data/shapes_task.py)
CODE_SOURCES = code_exec.CODE_SOURCES  # programs run on test cases in a sandbox


def known_data_sources() -> list[str]:
    """Every data source the default scorer handles (prefixes end with ``*``)."""
    prefixes = [f"{prefix}*" for prefix in DAPO_SOURCE_PREFIXES]
    synthetic = [*SYNTHETIC_SOURCES, *SHAPES_SOURCES]
    return [*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, *prefixes, *synthetic, *CODE_SOURCES]


def is_known_data_source(data_source: Any) -> bool:
    """Whether the default scorer has a rule for ``data_source``."""
    source = str(data_source)
    if source.startswith(DAPO_SOURCE_PREFIXES):
        return True
    return source in (
        *GSM8K_SOURCES,
        *MATH_SOURCES,
        *DAPO_SOURCES,
        *SYNTHETIC_SOURCES,
        *SHAPES_SOURCES,
        *CODE_SOURCES,
    )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score one response with the rule that fits its data source.

    Returns a float (gsm8k, MATH-style, synthetic) or a dict with ``score``,
    ``acc`` and ``pred`` (DAPO/AIME: +1/-1), or for code (``CODE_SOURCES``) with ``score``
    (pass rate, programs run in a sandbox) and a ``reward/sandbox/<cause>_count`` of a
    failure (see :mod:`.code_exec`). Keyword arguments: ``code_sandbox`` (a
    ``CodeSandboxConfig`` or its fields) and verl's ``memory_limit_mb`` set the code
    sandbox's limits; others are accepted and ignored.
    Raises NotImplementedError naming an unknown data source.
    """
    del extra_info  # the rule-based scorers do not need it
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_verify_score.compute_score(solution_str, ground_truth)
    if data_source in DAPO_SOURCES or str(data_source).startswith(DAPO_SOURCE_PREFIXES):
        return math_dapo.compute_score(solution_str, ground_truth)
    if data_source in SYNTHETIC_SOURCES:
        return synthetic.compute_score(solution_str, ground_truth)
    if data_source in SHAPES_SOURCES:
        return shapes.compute_score(solution_str, ground_truth)
    if data_source in CODE_SOURCES:
        return code_exec.compute_score(solution_str, ground_truth, config=_code_config(kwargs))
    raise NotImplementedError(
        f"default_compute_score: no reward rule for data_source={data_source!r}; known data sources: "
        f"{', '.join(known_data_sources())}. Set custom_reward_function.path to score other data."
    )


def _code_config(kwargs: dict[str, Any]) -> code_exec.CodeSandboxConfig:
    """``code_sandbox`` (the trainer's ``reward_model.sandbox``), with verl's ``memory_limit_mb``."""
    return code_exec.as_config(kwargs.get("code_sandbox"), kwargs.get("memory_limit_mb"))


def batch_default_compute_score(
    data_sources: Any,
    solution_strs: list[str],
    ground_truths: list[Any],
    extra_infos: Any = None,
    **kwargs: Any,
) -> list[float | dict[str, Any]]:
    """``default_compute_score`` over a batch, in the BatchRewardManager form."""
    if extra_infos is None:
        extra_infos = [None] * len(solution_strs)
    scores = [
        None if source in CODE_SOURCES else default_compute_score(source, solution, truth, extra, **kwargs)
        for source, solution, truth, extra in zip(data_sources, solution_strs, ground_truths, extra_infos)
    ]
    code = [i for i, source in enumerate(data_sources) if source in CODE_SOURCES]
    if code:  # programs run side by side, each in its own sandbox
        solutions, truths = [solution_strs[i] for i in code], [ground_truths[i] for i in code]
        batch = code_exec.compute_score_batch(solutions, truths, _code_config(kwargs))
        for i, score in zip(code, batch):
            scores[i] = score
    return scores


# The project's own rule-based scorers: regexes and math-verify (milliseconds, with their
# own parse/verify time limits), trusted to run inside the trainer. Anything else is
# user code, which reward managers run in a killable worker process by default.
BUILTIN_SCORERS = frozenset(
    {
        default_compute_score,
        batch_default_compute_score,
        code_exec.compute_score,  # trusted: it runs the untrusted programs in a sandbox
        gsm8k.compute_score,
        math_dapo.compute_score,
        math_verify_score.compute_score,
        synthetic.compute_score,
        shapes.compute_score,
    }
)


def is_builtin_scorer(fn: Any) -> bool:
    """True for the project's own scorers (see ``BUILTIN_SCORERS``), also with bound
    arguments (``functools.partial``, e.g. the trainer's code sandbox settings)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        return fn in BUILTIN_SCORERS
    except TypeError:  # an unhashable callable is not one of ours
        return False


__all__ = [
    "BUILTIN_SCORERS",
    "batch_default_compute_score",
    "default_compute_score",
    "is_builtin_scorer",
    "is_known_data_source",
    "known_data_sources",
]
