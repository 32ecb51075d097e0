"""Code-execution rewards: run a response's program on test cases, in a sandbox.

The data verl's code scorers read (data sources ``codecontests``, ``apps``, ``codeforces``,
``taco``): ``reward_model.ground_truth`` is a JSON string (or dict) with

- ``inputs`` / ``outputs``: one entry per case. Without ``fn_name`` the program reads the
  input on stdin and its stdout is compared with the output (verl prime_code's tolerant
  comparison: whitespace, blank lines, numbers within 1e-5). A list entry is joined by
  newlines.
- ``fn_name`` (optional): the program defines that function (or a ``Solution`` class with
  that method); each input line is one JSON argument and the return value is compared
  with the JSON output (tuples as lists; a list output also matches its first element).
- ``assert_case`` (optional, sandbox_fusion's form): code appended to the program for each
  case; ``inputs`` default to "" and ``outputs`` to None (None: passing is finishing).

The code is taken from the last ```` ```python ```` block of the response (the whole response
if there is none), as verl's prime_code does. The score is verl's continuous one: the
fraction of the first ``max_cases`` (10) cases passed, in [0, 1].

Every run is confined by :mod:`verl_megatron.reward.sandbox`. A sample that does not pass
is counted under one cause, the first failing case's: ``wrong_answer``, ``runtime_error``,
``syntax_error``, ``timeout``, ``cpu_limit``, ``memory``, ``output_limit``, ``crash``,
``network`` / ``process`` / ``filesystem`` / ``signal`` (the program failed after trying to
open a socket, start a process, write outside its directory, send a signal), ``no_code``,
``bad_tests`` or ``sandbox_error``. The scorer's dict carries ``reward/sandbox/<cause>_count``
= 1 for it, which the trainer sums into its reward metrics; a sample run in the sandbox's
``basic`` mode (no namespaces on this host) also carries ``reward/sandbox/basic_isolation_count``
= 1, so the degraded isolation shows in every step's metrics.

Differences from verl, on purpose: each of the first ``max_cases`` cases runs against a
fresh copy of the program as a script (verl's prime_code wraps a stdin program into a
function, and runs all cases first in one process); after a program kills its own
process (a crash, the CPU or wall limit) its remaining cases fail rather than restart;
a test set with no case scores 0 (``bad_tests``), not 1.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import site
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from verl_megatron.reward import sandbox
from verl_megatron.reward.scorers import code_harness

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
BASIC_ISOLATION_METRIC = "reward/sandbox/basic_isolation_count"
# Float comparison of stdout tokens: numpy.allclose's defaults, as verl's prime_code uses.
_RTOL, _ATOL = 1e-5, 1e-8


@dataclass
class CodeSandboxConfig:
    """How programs are run and scored (the trainer's ``reward_model.sandbox`` section).

    Attributes:
        case_timeout_s: CPU seconds per test case (verl's prime_code: 10, of wall time; CPU
            time does not shrink when rollouts share the machine).
        case_wall_factor: a case is also stopped after ``case_wall_factor * case_timeout_s``
            seconds of wall time (a program that sleeps or blocks).
        max_cases: cases run and scored, from the first (verl's continuous score: 10).
        memory_mb: address space of the program, in MiB (verl's sandbox_fusion default: 1024).
        file_size_mb: largest file the program may write, in MiB (a case's input included).
        max_processes: processes the program may run, itself included (1: none started).
        max_output_bytes: a case's stdout (or return value's repr) kept; longer fails.
        isolation: "auto", "namespaces" or "basic" (see :mod:`verl_megatron.reward.sandbox`).
        site_packages: whether the program may import the trainer's third-party packages
            (numpy, ...): their directories go on its sys.path, read-only.
        max_workers: programs run at once by the batch scorer (None: the CPU count).
        startup_s: seconds of CPU and wall time for starting the sandbox and interpreter,
            on top of ``case_timeout_s`` per case: the run's hard limits.
    """

    case_timeout_s: float = 10.0
    case_wall_factor: float = 2.0
    max_cases: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 32
    max_processes: int = 1
    max_output_bytes: int = 1 << 20
    isolation: str = "auto"
    site_packages: bool = True
    max_workers: int | None = None
    startup_s: float = 3.0

    def __post_init__(self) -> None:
        where = "reward_model.sandbox"
        names = ("case_timeout_s", "case_wall_factor", "max_cases", "memory_mb", "file_size_mb")
        sandbox.require_positive(self, names, where)
        for name in ("max_processes", "max_output_bytes"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{where}.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_workers is not None and not (isinstance(self.max_workers, int) and self.max_workers >= 1):
            raise ValueError(f"{where}.max_workers must be null or an integer >= 1, got {self.max_workers!r}")
        if not (isinstance(self.startup_s, (int, float)) and self.startup_s >= 0):
            raise ValueError(f"{where}.startup_s must be >= 0, got {self.startup_s!r}")
        if self.isolation not in sandbox.ISOLATION_MODES:
            raise ValueError(
                f"{where}.isolation must be one of {sandbox.ISOLATION_MODES}, got {self.isolation!r}"
            )

    def limits(self, num_cases: int) -> sandbox.SandboxLimits:
        cases = max(1, num_cases)
        return sandbox.SandboxLimits(
            cpu_s=self.case_timeout_s * cases + self.startup_s,
            wall_s=self.case_timeout_s * self.case_wall_factor * cases + self.startup_s + 1.0,
            memory_mb=self.memory_mb,
            file_size_mb=self.file_size_mb,
            max_processes=self.max_processes,
            max_output_bytes=8 * self.max_output_bytes * max(1, num_cases),
        )


DEFAULT_CONFIG = CodeSandboxConfig()


def as_config(value: Any = None, memory_limit_mb: int | None = None) -> CodeSandboxConfig:
    """A :class:`CodeSandboxConfig` from one, a mapping of its fields, or None (the default);
    ``memory_limit_mb`` (verl's keyword for its sandbox) overrides the memory limit."""
    if value is None:
        config = DEFAULT_CONFIG
    elif isinstance(value, CodeSandboxConfig):
        config = value
    elif hasattr(value, "items"):
        config = CodeSandboxConfig(**dict(value.items()))
    else:
        raise TypeError(
            f"code sandbox config must be a CodeSandboxConfig or a mapping, got {type(value).__name__}"
        )
    if memory_limit_mb is not None:
        config = dataclasses.replace(config, memory_mb=int(memory_limit_mb))
    return config


def extract_code(response: str) -> str:
    """The program in ``response``: the text of its last ```` ```python ```` block, or the
    whole response when it has none (verl prime_code's rule)."""
    return response.split("```python")[-1].split("```")[0]


def parse_tests(ground_truth: Any) -> dict[str, Any]:
    """The test cases from ``ground_truth`` (JSON text or a dict). Raises ValueError naming
    what is wrong."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict):
        raise ValueError(f"test cases must be a JSON object, got {type(tests).__name__}")
    asserts = tests.get("assert_case")
    if isinstance(asserts, list):
        tests = {"inputs": [""] * len(asserts), "outputs": [None] * len(asserts), **tests}
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("test cases need 'inputs' and 'outputs' lists (or an 'assert_case' list)")
    if len(inputs) != len(outputs) or (isinstance(asserts, list) and len(asserts) != len(inputs)):
        raise ValueError(f"{len(inputs)} inputs for {len(outputs)} outputs")
    if not inputs:
        raise ValueError("no test case")
    return tests


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _floats_close(got: list[str], want: list[str]) -> bool:
    if len(got) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(got, want)):
        return False  # integers are compared exactly (by the string checks)
    try:
        pairs = [(float(a), float(b)) for a, b in zip(got, want)]
    except ValueError:
        return False
    return all(abs(a - b) <= _ATOL + _RTOL * abs(b) or (a == b) for a, b in pairs)


def stdio_match(output: str, expected: Any) -> bool:
    """verl prime_code's stdout comparison, each of its checks: the whole text or its
    stripped lines equal once trimmed, the non-blank lines equal to the expected's
    non-blank stripped lines, or as many lines, not all integers, equal as numbers."""
    want = _text(expected)
    lines = output.splitlines()
    if (
        "\n".join(lines).strip() == want.strip()
        or "\n".join(s.strip() for s in lines).strip() == want.strip()
    ):
        return True
    if lines == [want]:
        return True
    want_lines = [s.strip() for s in want.split("\n") if s]
    got_lines = [s for s in lines if s]
    if lines == want_lines or got_lines == want_lines:
        return True
    return _floats_close(got_lines, want_lines)


def _int_keys(value: dict) -> dict:
    return {int(k): v for k, v in value.items()}


def call_match(result_repr: str | None, expected_json: Any) -> bool:
    """verl prime_code's comparison of a function's return value (sent back as its repr)
    with the expected JSON output."""
    if result_repr is None:
        return False
    try:
        expected = json.loads(expected_json) if isinstance(expected_json, str) else expected_json
        result = ast.literal_eval(result_repr)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    try:  # JSON object keys are strings: verl compares against int keys, one dict deep
        if isinstance(expected, dict):
            expected = [_int_keys(expected)]
        elif isinstance(expected, list) and expected and isinstance(expected[0], dict):
            expected = [_int_keys(expected[0])]
    except (ValueError, TypeError):
        pass
    if isinstance(result, tuple):
        result = list(result)
    if result == expected or (isinstance(expected, list) and expected and result == expected[0]):
        return True
    try:
        return isinstance(result[0], tuple) and [list(x) for x in result] == expected[0]
    except (TypeError, IndexError, KeyError):
        return False


def _site_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _case_cause(report: dict[str, Any] | None, passed: bool, run_cause: str) -> str | None:
    """Why a case failed (None: it passed)."""
    if report is None:  # the program ended the harness: the sandbox says how
        return {
            sandbox.TIMEOUT: "timeout",
            sandbox.CPU_LIMIT: "cpu_limit",
            sandbox.OUTPUT_LIMIT: "output_limit",
            sandbox.SANDBOX_ERROR: "sandbox_error",
        }.get(run_cause, "crash")
    if passed:
        return None
    status = report.get("status")
    if status in ("syntax_error", "timeout", "memory"):
        return status
    if report.get("event"):
        return report["event"]
    return "runtime_error" if status == "error" else "wrong_answer"


def _score_result(score: float, cause: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {"score": score}
    if cause is not None:
        result[f"reward/sandbox/{cause}_count"] = 1
    return result


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    config: CodeSandboxConfig | None = None,
) -> dict[str, Any]:
    """Score one response: ``{"score": pass rate of the first cases, "reward/sandbox/<cause>_count": 1}``
    (the count only when a case failed). Never raises for bad code or bad test data."""
    del extra_info  # verl's code scorers read only the ground truth
    config = config or DEFAULT_CONFIG
    code = extract_code(solution_str)
    if not code.strip():
        return _score_result(0.0, "no_code")
    try:
        tests = parse_tests(ground_truth)
    except (ValueError, TypeError):
        return _score_result(0.0, "bad_tests")
    count = min(len(tests["inputs"]), config.max_cases)
    asserts = tests.get("assert_case") or [""] * count
    fn_name = tests.get("fn_name") or None
    spec = {
        "code": code,
        "fn_name": fn_name,
        "case_timeout_s": config.case_timeout_s,
        "case_wall_s": config.case_timeout_s * config.case_wall_factor,
        "max_output_bytes": config.max_output_bytes,
        "site_dirs": _site_dirs() if config.site_packages else [],
        "cases": [{"input": _text(tests["inputs"][i]), "append": asserts[i] or ""} for i in range(count)],
    }
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", code_harness.__file__]
    # The sandbox's root holds the interpreter; the harness and the packages it may import join it.
    expose = [code_harness.__file__, *spec["site_dirs"]]
    run = sandbox.run_sandboxed(
        argv, json.dumps(spec).encode(), config.limits(count), config.isolation, expose=expose
    )
    reports: dict[int, dict[str, Any]] = {}
    for line in run.stdout.decode("utf-8", errors="replace").splitlines():
        try:
            report = json.loads(line)
            reports.setdefault(int(report["case"]), report)
        except (ValueError, KeyError, TypeError):
            continue  # a program that wrote over the harness's channel gets nothing for it
    passed, cause = 0, None
    for index in range(count):
        report = reports.get(index)
        ok = (
            report is not None
            and report.get("status") == "ok"
            and _case_passes(report, tests, index, fn_name)
        )
        passed += ok
        cause = cause or _case_cause(report, ok, run.cause)
    result = _score_result(passed / count, cause)
    if run.mode == sandbox.BASIC:  # the degraded isolation is counted, not only logged once
        result[BASIC_ISOLATION_METRIC] = 1
    return result


def _case_passes(report: dict[str, Any], tests: dict[str, Any], index: int, fn_name: str | None) -> bool:
    expected = tests["outputs"][index]
    output = report.get("output")
    if fn_name is not None:
        return call_match(output, expected)
    if expected is None:  # an assert case: finishing is passing
        return True
    return isinstance(output, str) and stdio_match(output, expected)


def compute_score_batch(
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    config: CodeSandboxConfig | None = None,
) -> list[dict[str, Any]]:
    """:func:`compute_score` for many responses, ``config.max_workers`` sandboxes at once."""
    config = config or DEFAULT_CONFIG
    workers = config.max_workers or os.cpu_count() or 1
    if len(solution_strs) <= 1 or workers == 1:
        return [compute_score(s, g, config=config) for s, g in zip(solution_strs, ground_truths)]
    with ThreadPoolExecutor(max_workers=min(workers, len(solution_strs))) as pool:
        return list(
            pool.map(lambda pair: compute_score(*pair, config=config), zip(solution_strs, ground_truths))
        )


def map_side_by_side(
    fn: Callable[..., Any],
    kwargs_list: Sequence[dict[str, Any]],
    call: Callable[[Callable[..., Any], dict], Any],
) -> list[Any]:
    """``[call(fn, kwargs) for kwargs in kwargs_list]``, where the default scorer's calls on
    code data sources run side by side in threads (each only waits on its sandbox), up to
    the bound ``code_sandbox``'s ``max_workers``; every other call runs here, in order
    (the math scorers' own time limits need the main thread)."""
    from verl_megatron.reward.scorers import default_compute_score  # it imports this module

    base, bound = fn, {}
    while isinstance(base, functools.partial):
        base, bound = base.func, {**base.keywords, **bound}
    code = [
        i
        for i, kwargs in enumerate(kwargs_list)
        if base is default_compute_score and kwargs.get("data_source") in CODE_SOURCES
    ]
    workers = as_config(bound.get("code_sandbox")).max_workers or os.cpu_count() or 1
    if len(code) < 2 or workers == 1:
        return [call(fn, kwargs) for kwargs in kwargs_list]
    results: list[Any] = [None] * len(kwargs_list)
    with ThreadPoolExecutor(max_workers=min(workers, len(code))) as pool:
        futures = {i: pool.submit(call, fn, kwargs_list[i]) for i in code}
        for i, kwargs in enumerate(kwargs_list):
            if i not in futures:
                results[i] = call(fn, kwargs)
        for i, future in futures.items():
            results[i] = future.result()
    return results


__all__ = [
    "CODE_SOURCES",
    "DEFAULT_CONFIG",
    "CodeSandboxConfig",
    "as_config",
    "call_match",
    "compute_score",
    "compute_score_batch",
    "extract_code",
    "map_side_by_side",
    "parse_tests",
    "stdio_match",
]
