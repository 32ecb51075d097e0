"""Run a ``rollout.placement=separate`` job script on the ranks of a test pool (``pool2``).

Separate placement starts torch.distributed itself, as a torchrun worker does
(``rollout/placement.py``), and a pool worker already has a process group. ``run_main`` lends
the pool's ranks to a script written for ``torchrun --nproc_per_node=N tests/<script>.py OUT``:
it keeps the pool's store, releases the pool's group, runs the script's ``main(OUT)`` with the
store standing in for torchrun's agent store (its ranks are clients of it, as under torchrun),
then forms the pool's group again over that store. A launch costs an agent and an interpreter a
rank importing megatron (about 15 CPU seconds for two ranks); the pool's ranks have them.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import os
import secrets
import tempfile


def run_main(module: str, out: str) -> tuple[str, str]:
    """``module.main(out)`` on every pool rank, as under torchrun; this rank's (stdout, stderr)."""
    import torch.distributed as dist

    from verl_megatron.distributed.parallel import shutdown

    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()  # rank 0 serves it while it is referenced
    again = [secrets.token_hex(4)]  # the key prefix of the pool's group formed again afterwards
    dist.broadcast_object_list(again, src=0)
    shutdown()
    saved = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank a client of the store
    try:
        return _captured(importlib.import_module(module).main, out)
    finally:
        faulthandler.cancel_dump_traceback_later()  # a script's hang timer ends with it
        if saved is None:
            del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
        else:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved
        if dist.is_initialized():  # the script failed inside a run
            shutdown()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"pool_{again[0]}", store), rank=rank, world_size=world,
            timeout=datetime.timedelta(minutes=30),
        )  # fmt: skip


def _captured(main, out: str) -> tuple[str, str]:
    """``main(out)``'s output. Files, not strings: a script may hand stderr's descriptor to
    faulthandler."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            main(out)
        return _read(stdout), _read(stderr)


def _read(file) -> str:
    file.flush()
    file.seek(0)
    return file.read()
