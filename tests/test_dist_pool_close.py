"""Closing a DistPool whose workers never built megatron's parallel state does not import megatron:
the import (about 6 s per worker) only to find no groups to destroy made an idle pool's close take
12-16 s.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch.distributed as dist

from verl_megatron.distributed.dist_pool import DistPool


def _write_loaded(path: str) -> None:
    with open(path, "w") as f:
        json.dump(sorted(m for m in ("megatron", "megatron.core") if m in sys.modules), f)


def report_megatron_at_exit_job(folder: str) -> bool:
    """Whether megatron is loaded now; at the worker's exit (after close's shutdown), whether it is
    loaded then, in ``folder/<rank>.json``."""
    atexit.register(_write_loaded, os.path.join(folder, f"{dist.get_rank()}.json"))
    return "megatron" in sys.modules


def test_closing_a_pool_that_built_no_megatron_state_does_not_import_megatron(tmp_path):
    pool = DistPool(2)
    try:
        assert pool.run(f"{__name__}:report_megatron_at_exit_job", folder=str(tmp_path)) == [False, False]
    finally:
        pool.close()
    loaded = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)}
    assert loaded == {0: [], 1: []}
