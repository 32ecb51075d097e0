"""How a DistPool's workers end when it closes.

Closing a pool whose workers never built megatron's parallel state does not import megatron: the
import (about 6 s per worker) only to find no groups to destroy made an idle pool's close take
12-16 s. And a worker ends with its exit handlers but without the interpreter's teardown: tearing
down a process that loaded torch and megatron took ~3 s per worker (closing the session's pool1
and pool2 cost 12-14 s of the last test file's teardown on a loaded machine).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch.distributed as dist

from verl_megatron.distributed.dist_pool import DistPool


class _MarkWhenFreed:
    """Writes ``path`` when freed: an object held by a module global is freed only by the
    interpreter's teardown at exit."""

    def __init__(self, path: str) -> None:
        self.path = path

    # os's functions bound now: late in the teardown, module globals and builtins are gone.
    def __del__(self, _open=os.open, _close=os.close, _flags=os.O_CREAT | os.O_WRONLY) -> None:
        _close(_open(self.path, _flags))


_held_until_teardown: list[_MarkWhenFreed] = []


def _write_loaded(path: str) -> None:
    with open(path, "w") as f:
        json.dump(sorted(m for m in ("megatron", "megatron.core") if m in sys.modules), f)


def report_megatron_at_exit_job(folder: str) -> bool:
    """Whether megatron is loaded now; at the worker's exit (after close's shutdown), whether it is
    loaded then, in ``folder/<rank>.json``; ``folder/<rank>.teardown`` if the interpreter's
    teardown ran."""
    rank = dist.get_rank()
    atexit.register(_write_loaded, os.path.join(folder, f"{rank}.json"))
    _held_until_teardown.append(_MarkWhenFreed(os.path.join(folder, f"{rank}.teardown")))
    return "megatron" in sys.modules


def test_closing_a_pool_runs_exit_handlers_skips_teardown_and_imports_no_megatron(tmp_path):
    pool = DistPool(2)
    try:
        assert pool.run(f"{__name__}:report_megatron_at_exit_job", folder=str(tmp_path)) == [False, False]
    finally:
        pool.close()
    loaded = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)}
    assert loaded == {0: [], 1: []}
    assert sorted(p.name for p in tmp_path.glob("*.teardown")) == []
