"""``verl-megatron train`` for several processes run by the test's own interpreter.

The CLI re-launches a multi-process job with torch's launcher called in-process
(``verl_megatron.cli._torchrun``): the launcher's work is the same whether the CLI runs in a fresh
``python -m verl_megatron.cli`` or here, but a fresh interpreter costs ~6 CPU s of imports that the
test process has paid already. ``warm_ranks`` has the launcher's ranks forked from a warm process
(tests/warm_workers.py) instead of fresh interpreters, where what the ranks do is the subject and
not how an interpreter starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.warm_workers import SOCKET_VAR, python_wrapper, zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The launcher installs handlers for these and leaves them installed.
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@contextmanager
def warm_ranks(folder: str, *prefix: str) -> Iterator[dict[str, str]]:
    """The environment under which the launcher's ranks are forked by a zygote: torch's launcher
    runs ``$PYTHON_EXEC -u -m verl_megatron.train ARGS``, and ``PYTHON_EXEC`` is a script that
    hands ``-m verl_megatron.train ARGS`` to the zygote's client (which takes no ``-u``: the forked
    rank's output is unbuffered already). ``prefix``: see ``python_wrapper`` (``-m
    tests.warm_script`` for a launcher that runs a script)."""
    path = python_wrapper(folder, *prefix)
    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")
    }
    with zygote({**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}, ROOT) as socket_path:
        yield {"PYTHON_EXEC": path, SOCKET_VAR: socket_path}


def run_cli(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``verl-megatron ARGV`` from a shell outside torchrun (no WORLD_SIZE, one thread per rank),
    with ``env`` added (``warm_ranks``): its exit status and what it and its ranks wrote to stdout
    and stderr."""
    from verl_megatron import cli

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    handlers = {number: signal.getsignal(number) for number in _SIGNALS}
    capfd.readouterr()
    try:
        code = cli.main(argv)
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)
