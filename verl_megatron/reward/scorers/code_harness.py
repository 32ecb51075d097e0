"""Runs a candidate program on test cases, inside the sandbox (standard library only).

Started as ``python -I -B -X utf8 code_harness.py`` by :mod:`.code_exec` through
:mod:`verl_megatron.reward.sandbox`. Reads one JSON spec on stdin::

    {"code": str, "fn_name": str | None, "case_timeout_s": float, "case_wall_s": float,
     "max_output_bytes": int,
     "site_dirs": [str], "cases": [{"input": str, "append": str}]}

and writes one JSON line per case on the stdout it was started with::

    {"case": i, "status": "ok" | "timeout" | "memory" | "error" | "syntax_error",
     "output": stdout text (stdin mode) or repr of the return value (call mode),
     "event": category of the last sensitive call the case made, or null, "error": str}

The expected outputs never enter the sandbox: the parent compares, so a program cannot
read the answers from this process. Each case runs against a fresh copy of the program
(as verl's per-case runs do), with its input on fd 0 and its output captured from fd 1
(``print``, ``sys.stdout.write``, ``open(0).read()`` and ``os.read(0, ...)`` behave as in a
plain script). A case is interrupted after ``case_timeout_s`` of CPU time (a measure that a
busy machine does not shrink) or ``case_wall_s`` of wall time (a program that sleeps or
waits); the sandbox's own CPU/wall limits stop a program that ignores the timers.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import sys

# Names verl's prime_code makes available to every program without an import.
PREAMBLE_MODULES = [
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
]
PREAMBLE_STAR = [*PREAMBLE_MODULES, "builtins", "typing"]
PREAMBLE = (
    "".join(f"from {m} import *\n" for m in PREAMBLE_STAR)
    + "".join(f"import {m}\n" for m in PREAMBLE_MODULES)
    + "sys.setrecursionlimit(6 * 10**5)\n"
)

# Audit events (PEP 578) that say what a failing program was trying to do: counted as the
# cause of its failure. They only label; the kernel-side limits are what enforce.
_EVENT_CATEGORIES = (
    ("socket.", "network"),
    ("os.fork", "process"),
    ("os.forkpty", "process"),
    ("os.posix_spawn", "process"),
    ("os.spawn", "process"),
    ("os.exec", "process"),
    ("os.system", "process"),
    ("subprocess.Popen", "process"),
    ("os.kill", "signal"),
    ("os.killpg", "signal"),
    ("signal.pthread_kill", "signal"),
    ("os.remove", "filesystem"),
    ("os.rename", "filesystem"),
    ("os.rmdir", "filesystem"),
    ("os.mkdir", "filesystem"),
    ("os.truncate", "filesystem"),
    ("os.chmod", "filesystem"),
    ("os.chown", "filesystem"),
    ("os.symlink", "filesystem"),
    ("os.link", "filesystem"),
    ("shutil.", "filesystem"),
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


_HARNESS_PID = os.getpid()
_WORKDIR = os.getcwd()


def _path(name: str) -> str:
    return os.path.join(_WORKDIR, name)


class _CaseTimeout(BaseException):
    """Raised by the timer; a BaseException so a program's ``except Exception`` keeps it."""


class _Recorder:
    """Audit hook: remembers the category of the last sensitive call of the running case.
    Writes inside the working directory are the program's own business and not recorded."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.active = False
        self.event: str | None = None

    def _outside(self, path: object) -> bool:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False  # a file descriptor
        return os.path.commonpath([self.workdir, os.path.abspath(path)]) != self.workdir

    def __call__(self, name: str, args: tuple) -> None:
        if not self.active:
            return
        if name == "open":
            mode, flags = (args[1], args[2]) if len(args) > 2 else (None, 0)
            writing = any(c in str(mode or "") for c in "wax+") or bool((flags or 0) & _WRITE_FLAGS)
            if writing and self._outside(args[0]):
                self.event = "filesystem"
            return
        for prefix, category in _EVENT_CATEGORIES:
            if name.startswith(prefix):
                if category != "filesystem" or (args and self._outside(args[0])):
                    self.event = category
                return


_timer_fired = False


def _on_timer(signum: int, frame: object) -> None:
    # The CPU and wall timers can both expire in one case (under load they come close); the
    # second must not raise again while the first timeout is being handled, or it escapes
    # run_case and the case reads as a harness error instead of a timeout.
    global _timer_fired
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if not _timer_fired:
        _timer_fired = True
        raise _CaseTimeout


def _classify(err: BaseException) -> str:
    if isinstance(err, _CaseTimeout):
        return "timeout"
    if isinstance(err, MemoryError):
        return "memory"
    return "error"


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        return ""  # over the cap: no prefix of it can be right
    return data.decode("utf-8", errors="replace")


def _redirect(case_input: str) -> None:
    """fd 0 <- the case's input, fd 1 -> a fresh output file, in the working directory
    (by absolute path: the previous case may have changed directory)."""
    with open(_path("stdin.txt"), "w", encoding="utf-8") as f:
        f.write(case_input)
    for fd, name, flags in (
        (0, "stdin.txt", os.O_RDONLY),
        (1, "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        new = os.open(_path(name), flags, 0o600)
        if new != fd:  # the program may have closed fd 0 or 1, which os.open then reuses
            os.dup2(new, fd)
            os.close(new)
    # The program's sys.stdin/stdout for this case (closefd=False: the fds are reused).
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115


def _target(namespace: dict, code: str, fn_name: str):
    if "class Solution" in code:  # verl: a LeetCode-style class is instantiated first
        return getattr(namespace["Solution"](), fn_name)
    return namespace[fn_name]


def _call_args(case_input: str) -> list:
    args = [json.loads(line) for line in case_input.split("\n")]
    try:  # JSON keys are strings; verl turns a leading dict's keys back into ints
        if isinstance(args[0], dict):
            args = [{int(k): v for k, v in args[0].items()}]
    except (ValueError, TypeError):
        pass
    return args


def run_case(compiled, code: str, fn_name: str | None, case: dict, spec: dict, recorder: _Recorder) -> dict:
    """Run one case; the result dict is what the parent compares and counts."""
    extra = compile(case["append"], "<assert_case>", "exec") if case.get("append") else None
    _redirect(case["input"])
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    output = None
    status, error = "ok", ""
    recorder.event = None
    global _timer_fired
    _timer_fired = False
    signal.setitimer(signal.ITIMER_PROF, spec["case_timeout_s"])
    signal.setitimer(signal.ITIMER_REAL, spec["case_wall_s"])
    recorder.active = True
    try:
        try:
            exec(compiled, namespace)
            if extra is not None:
                exec(extra, namespace)
            if fn_name is not None:
                output = repr(_target(namespace, code, fn_name)(*_call_args(case["input"])))
        except SystemExit:
            pass  # verl counts a program that exits as finished; its output is compared
    except BaseException as err:
        status, error = _classify(err), f"{type(err).__name__}: {err}"[:500]
    finally:
        if os.getpid() != _HARNESS_PID:
            os._exit(0)  # a fork the program made (where the limits allow one) reports nothing
        recorder.active = False
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        sys.stdout.flush()
    except BaseException as err:  # e.g. the file-size limit hit on the last write
        if status == "ok":
            status, error = "error", f"{type(err).__name__}: {err}"[:500]
    if fn_name is None:
        output = _read_capped(_path("stdout.txt"), spec["max_output_bytes"])
    elif output is not None and len(output) > spec["max_output_bytes"]:
        output = ""
    return {"status": status, "output": output, "event": recorder.event, "error": error}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    spec = json.loads(sys.stdin.buffer.read())
    sys.path.extend(spec.get("site_dirs", []))  # third-party packages, without running .pth files
    recorder = _Recorder(_WORKDIR)
    sys.addaudithook(recorder)
    signal.signal(signal.SIGALRM, _on_timer)
    signal.signal(signal.SIGPROF, _on_timer)
    code, fn_name = spec["code"], spec.get("fn_name")
    try:
        compiled = compile(PREAMBLE + code, "<solution>", "exec")
    except (SyntaxError, ValueError) as err:
        for index in range(len(spec["cases"])):
            result = {"status": "syntax_error", "output": None, "event": None, "error": str(err)[:500]}
            channel.write(json.dumps({"case": index, **result}) + "\n")
        channel.flush()
        return
    for index, case in enumerate(spec["cases"]):
        try:
            result = run_case(compiled, code, fn_name, case, spec, recorder)
        except BaseException as err:  # the harness itself failed (e.g. a bad assert_case)
            result = {"status": "error", "output": None, "event": None, "error": repr(err)[:500]}
        channel.write(json.dumps({"case": index, **result}) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
