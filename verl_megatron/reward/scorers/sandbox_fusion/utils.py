"""Test cases run through a SandboxFusion-style code runner (verl's
``utils.reward_score.sandbox_fusion.utils``).

`call_sandbox_api` sends one program and one stdin to a runner and returns its JSON answer:
to a SandboxFusion server (``sandbox_fusion_url`` = its ``/run_code`` address, POST, retried on
a 504) or, with ``sandbox_fusion_url="local"``, to this project's own sandbox
(:mod:`verl_megatron.reward.sandbox`, Python only), answered in SandboxFusion's format.
`check_correctness` runs every case of a problem concurrently and grades each:

    True   ran, output right        False  ran, output wrong
    -1     request or sandbox error -2     runtime error (non-zero exit, crash)
    -3     run time limit           -4     compile error or compile time limit

With ``fn_name`` (LeetCode style) the program is wrapped: each stdin line is a JSON argument,
the function (or ``Solution().<fn_name>``) is called, and its result printed (JSON for
containers, bools and None); a failing call prints its traceback to stderr and nothing
else. An ``assert_case`` entry is appended to the program of its case.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from verl_megatron.reward import sandbox

__all__ = ["LOCAL_URL", "SUPPORTED_LANGUAGES", "call_sandbox_api", "check_correctness"]

logger = logging.getLogger(__name__)

LOCAL_URL = "local"
SUPPORTED_LANGUAGES = (
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
    "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket",
)  # fmt: skip
MAX_RETRIES = 3
RETRY_DELAY_S = 1.0  # times the attempt number
API_TIMEOUT_S = 10  # on top of the compile and run timeouts


def _run_local(code: str, stdin: str | None, run_timeout: float, memory_limit_mb: int) -> dict[str, Any]:
    """Run Python `code` in the project's sandbox; the result in SandboxFusion's format."""
    # SandboxFusion's run timeout is wall time; one more second covers the interpreter's start.
    limits = sandbox.SandboxLimits(
        cpu_s=run_timeout, wall_s=run_timeout + 1.0, memory_mb=int(memory_limit_mb)
    )
    argv = [sys.executable, "-I", "-B", "-c", code]
    run = sandbox.run_sandboxed(argv, (stdin or "").encode(), limits)
    if run.cause == "sandbox_error":
        return {
            "status": "SandboxError",
            "message": run.stderr.decode("utf-8", "replace"),
            "run_result": None,
        }
    status = {"exited": "Finished", "timeout": "TimeLimitExceeded", "cpu_limit": "TimeLimitExceeded"}.get(
        run.cause, "Error"
    )
    result = {
        "status": status,
        "execution_time": run.wall_s,
        "return_code": run.returncode,
        "stdout": run.stdout.decode("utf-8", "replace"),
        "stderr": run.stderr.decode("utf-8", "replace"),
    }
    ok = status == "Finished" and run.returncode == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": result,
    }


def _post(url: str, payload: bytes, timeout: float) -> tuple[dict[str, Any] | None, str | None]:
    """POST with up to MAX_RETRIES attempts while the gateway times out (504)."""
    error = "API Call Failed after retries"
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    for attempt in range(1, MAX_RETRIES + 1):
        request = urllib.request.Request(url, data=payload, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read().decode("utf-8")), None
        except urllib.error.HTTPError as exc:
            if exc.code != 504:
                return None, f"API Call Failed: API Request Error: {exc}"
            error = f"API Call Failed: Gateway Timeout (504) on attempt {attempt}/{MAX_RETRIES}"
            if attempt < MAX_RETRIES:
                time.sleep(RETRY_DELAY_S * attempt)
        except (urllib.error.URLError, OSError, ValueError) as exc:  # unreachable, timed out, not JSON
            return None, f"API Call Failed: API Request Error: {exc}"
    return None, error


def call_sandbox_api(
    sandbox_fusion_url: str,
    code: str,
    stdin: str | None,
    compile_timeout: int,
    run_timeout: int,
    memory_limit_mb: int,
    language: str = "python",
) -> tuple[dict[str, Any] | None, str | None]:
    """(the runner's JSON answer, None), or (None, an error message) when there is none."""
    if language not in SUPPORTED_LANGUAGES:
        return None, f"Unsupported language: {language}"
    if sandbox_fusion_url == LOCAL_URL:
        if language != "python":
            return None, f"the local sandbox runs python only, not {language}"
        return _run_local(code, stdin, run_timeout, memory_limit_mb), None
    payload = {
        "compile_timeout": compile_timeout,
        "run_timeout": run_timeout,
        "code": code,
        "stdin": stdin,
        "memory_limit_MB": memory_limit_mb,
        "language": language,
        "files": {},
        "fetch_files": [],
    }
    return _post(
        sandbox_fusion_url, json.dumps(payload).encode(), compile_timeout + run_timeout + API_TIMEOUT_S
    )


_FN_WRAPPER = """
{generation}

import json as _json
import sys as _sys


def _call_{fn_name}():
    raw = _sys.stdin.read()
    args = [_json.loads(line) for line in raw.split("\\n")] if raw.strip() else []
    target = globals().get("{fn_name}")
    if target is None and "Solution" in globals():
        target = getattr(Solution(), "{fn_name}")
    if target is None:
        raise NameError("function or method {fn_name!r} not found")
    return target(*args)


try:
    _result = _call_{fn_name}()
except Exception:  # reported on stderr; the case then fails on its (missing) output, as in verl
    import traceback as _traceback

    _traceback.print_exc()
else:
    if _result is None or isinstance(_result, (bool, dict, list, tuple)):
        print(_json.dumps(_result))
    else:
        print(_result)
"""

# A function-call program sees these names unqualified, as LeetCode-style solutions assume.
_FN_PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
    "from itertools import *\nfrom functools import *\nfrom math import *\nimport math, string, re, sys\n"
)


def _program(generation: str, fn_name: str | None, language: str) -> str:
    if not fn_name or language != "python":
        return generation
    return _FN_PRELUDE + _FN_WRAPPER.format(generation=generation, fn_name=fn_name)


def _grade(response: dict[str, Any], expected: Any) -> tuple[bool | int, str]:
    """(grade, status) of one SandboxFusion answer; see the module docstring."""
    compile_result, run = response.get("compile_result") or {}, response.get("run_result") or {}
    api_status = response.get("status")
    if api_status == "SandboxError":
        return -1, "sandbox_error"
    if api_status == "Success":
        if run.get("status") != "Finished":
            return -1, "unexpected_success_state"
        got = run.get("stdout") or ""
        if expected is None or str(got).rstrip("\n") == str(expected).rstrip("\n"):
            return True, "success"
        return False, "wrong_answer"
    if api_status != "Failed":
        return -1, "unknown_api_status"
    compile_status = compile_result.get("status")
    if compile_status == "TimeLimitExceeded":
        return -4, "compile_timeout"
    if compile_status == "Error" or (compile_status == "Finished" and compile_result.get("return_code") != 0):
        return -4, "compile_error"
    if run.get("status") == "TimeLimitExceeded":
        return -3, "timeout"
    if run.get("status") == "Error" or (run.get("status") == "Finished" and run.get("return_code") != 0):
        return -2, "runtime_error"
    return -1, "unknown_failure"


def _run_case(
    index: int, stdin: Any, expected: Any, code: str, options: dict[str, Any]
) -> tuple[bool | int, dict]:
    """Run and grade case `index`; `options`: url, timeout, memory, language, semaphore."""
    text = None if stdin is None else str(stdin)
    semaphore = options["semaphore"]
    call = {
        "sandbox_fusion_url": options["url"],
        "code": code,
        "stdin": text,
        "compile_timeout": options["timeout"],
        "run_timeout": options["timeout"],
        "memory_limit_mb": options["memory_limit_mb"],
        "language": options["language"],
    }
    try:
        if semaphore is not None:
            with semaphore:  # a limit shared by every process scoring against one server
                response, error = call_sandbox_api(**call)
        else:
            response, error = call_sandbox_api(**call)
    except Exception as exc:  # a runner failure grades the case -1, it does not end the step
        response, error = None, f"API Request Exception for case {index + 1}: {exc}"
    meta: dict[str, Any] = {
        "case_index": index,
        "input": text,
        "expected_output": str(expected) if expected else None,
        "api_request_error": error,
        "api_response": response,
        "status": "api_error",
    }
    if error or not response:
        return -1, meta
    run, compile_result = response.get("run_result") or {}, response.get("compile_result") or {}
    meta.update(api_status=response.get("status"), compile_status=compile_result.get("status"))
    meta.update(
        compile_duration=compile_result.get("execution_time"), compile_stderr=compile_result.get("stderr")
    )
    meta.update(run_status=run.get("status"), stdout=run.get("stdout"), stderr=run.get("stderr"))
    meta.update(exit_code=run.get("return_code"), duration=run.get("execution_time"))
    grade, meta["status"] = _grade(response, expected)
    return grade, meta


def check_correctness(
    sandbox_fusion_url: str,
    in_outs: dict[str, Any] | None,
    generation: str,
    timeout: int = 10,
    memory_limit_mb: int = 1024,
    language: str = "python",
    concurrent_semaphore: Any = None,
) -> tuple[list[bool | int], list[dict[str, Any]]]:
    """(grade per case, metadata per case), in the cases' order. `in_outs`: ``inputs`` and
    ``outputs`` lists, optional ``fn_name`` and ``assert_case``. `concurrent_semaphore` (a
    threading or multiprocessing semaphore) bounds the calls in flight across callers. After
    a compile error, later cases are graded -4 too (the same program cannot compile)."""
    if not in_outs or "inputs" not in in_outs or "outputs" not in in_outs:
        return [-1], [{"error": "Invalid input/output data"}]
    inputs, outputs = in_outs["inputs"], in_outs["outputs"]
    count = len(inputs)
    if count == 0:
        return [], []
    asserts = in_outs.get("assert_case", [""] * count)
    if len(outputs) != count or len(asserts) != count:
        return [-1] * count, [{"error": "Input/output count mismatch", "case_index": i} for i in range(count)]
    options = {
        "url": sandbox_fusion_url,
        "timeout": timeout,
        "memory_limit_mb": memory_limit_mb,
        "language": language,
        "semaphore": concurrent_semaphore,
    }
    fn_name = in_outs.get("fn_name")
    programs = [_program(f"{generation}\n\n{asserts[i]}", fn_name, language) for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, count)) as pool:
        futures = [
            pool.submit(_run_case, i, inputs[i], outputs[i], programs[i], options) for i in range(count)
        ]
        graded = [future.result() for future in futures]
    results, metadata = [grade for grade, _ in graded], [meta for _, meta in graded]
    first_compile_error = next((i for i, grade in enumerate(results) if grade == -4), None)
    if first_compile_error is not None:
        for i in range(first_compile_error + 1, count):
            results[i] = -4
            metadata[i]["status"] = "compile_error_skipped"
    return results, metadata
