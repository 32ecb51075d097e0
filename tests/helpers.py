"""Small pieces several test modules share: the tiny models they build on the spot and their references."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# The small scoring models of the reward tests (reward models and the native judge): hidden 32,
# 4 attention heads over 2 key/value groups, FFN 64. Passed as ``**SMALL_MODEL`` to
# ``build_tiny_hf_model`` / ``build_tiny_reward_model``.
SMALL_MODEL = {"hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def save_tiny_models(root: Path, cases: dict[str, dict], make: Callable[[str, dict], Any]) -> dict[str, str]:
    """``make(path, spec)`` for every case, each in its own folder under ``root``; name -> path."""
    paths = {}
    for name, spec in cases.items():
        paths[name] = str(root / name)
        make(paths[name], spec)
    return paths


def hf_reference_logits(
    paths: dict[str, str], sequences: list[torch.Tensor]
) -> dict[str, list[torch.Tensor]]:
    """transformers' float32 logits on CPU for each checkpoint: name -> one [T, V] tensor per sequence."""
    from verl_megatron.tools.check_hf import hf_logits

    return {name: hf_logits(path, sequences, torch.device("cpu")) for name, path in paths.items()}


def save_tiny_llama(
    path: str | Path, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
    init_std: float, seed: int = 3, eos: int = 1, pad: int = 0,
) -> None:  # fmt: skip
    """A random Llama saved to ``path``: no BOS, token ``eos`` ends and ``pad`` pads. A large
    ``init_std`` makes next-token distributions peaked (greedy choices far from ties)."""
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(
        path, "llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, intermediate_size=ffn, seed=seed, initializer_range=init_std,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
    )  # fmt: skip


def saved_model(tmp_path_factory: Any, name: str, build: Callable[[str], Any]) -> str:
    """``build(path)`` into a fresh temporary folder named after ``name``; the folder's path."""
    path = str(tmp_path_factory.mktemp(name))
    build(path)
    return path


def run_per_variant(pool: Any, job: str, folder: Callable[[], Path], variants: dict[Any, list[str]]) -> dict:
    """``job`` on ``pool`` once per variant, each with its overrides and a ``run`` folder under a
    fresh ``folder()``; variant -> the first rank's result."""
    return {
        key: pool.run(job, out_dir=str(folder() / "run"), overrides=overrides)[0]
        for key, overrides in variants.items()
    }


def cli_train_job(
    argv: list[str], file_limit: int | None = None, entry: str = "verl_megatron.train", cwd: str | None = None
) -> Any:
    """Runs in a pool worker: ``python -m verl_megatron.train ARGV`` in-process, its exit status and
    output as a subprocess's (a fresh interpreter would import megatron again for every run).
    ``file_limit``: ``ulimit -f`` in bytes for the run (writes past it fail with EFBIG).
    ``entry``: the module whose ``main(ARGV)`` runs (``verl_megatron.cli``: ``verl-megatron ARGV``).
    ``cwd``: the folder it runs in (a command's relative paths), the worker's own restored after."""
    import contextlib
    import importlib
    import io
    import resource
    import signal
    import subprocess

    main = importlib.import_module(entry).main

    out, err = io.StringIO(), io.StringIO()
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.getsignal(signal.SIGXFSZ)
    try:
        if file_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, old_limit[1]))
        folder = contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext()
        with folder, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def advised_huge_pages(address: int) -> bool:
    """Whether the mapping that holds ``address`` carries ``madvise(MADV_HUGEPAGE)``: the ``hg``
    flag of its ``VmFlags`` line in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"address {address:#x} is in no mapping of /proc/self/smaps")


def run_forked(function: Callable[[str], Any], out_dir: str) -> subprocess.CompletedProcess:
    """``function(out_dir)`` in a child forked from this process, as a process of its own would run
    it (with this process's imports: megatron's ~6 CPU s a fresh interpreter pays again): its exit
    status (``os._exit`` included) and what it wrote to stdout and stderr (files in ``out_dir``)."""
    paths = [os.path.join(out_dir, name) for name in ("stdout", "stderr")]
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        os._exit(_child(function, out_dir, paths))
    _, status = os.waitpid(pid, 0)
    out, err = (_read(path) for path in paths)
    return subprocess.CompletedProcess([function.__name__], os.waitstatus_to_exitcode(status), out, err)


def _child(function, out_dir: str, paths: list[str]) -> int:
    """The forked child's exit status, with stdout and stderr in ``paths`` (line-buffered: open
    until ``os._exit``, the watchdog writes its line from another thread)."""
    try:
        for fd, path in zip((1, 2), paths, strict=True):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        function(out_dir)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
