"""Shared fixtures: persistent pools of torch.distributed workers (see verl_megatron.distributed.dist_pool),
``no_runtime`` for the tests of errors that must be raised before any process group starts, and
``model_path``, the tiny Llama of the actor / critic update tests (a module may define its own)."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite starts hundreds of interpreters (torchrun ranks, CLI runs, launchers). With
# PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) and a venv installed with --no-compile, no
# bytecode is ever written and every one of them compiles torch, megatron and transformers from
# source again: 14.6 instead of 6.6 CPU seconds for a training rank's imports, measured. The first
# import writes the bytecode; the rest reuse it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Files that take the longest (seconds summed over their tests on a 2-core machine). Under
# ``-n 2 --dist loadfile`` a worker takes whole files; xdist's default order (most tests first)
# leaves these few-test files for the end, where one worker runs the last of them alone.
_LONG_FILES = {
    "test_benchmarks_smoke.py": 85,
    "test_restart.py": 78,
    "test_quickstart.py": 75,
    "test_commands.py": 71,
    "test_stall_watchdog.py": 65,
    "test_panel_linear.py": 45,
    "test_parity_steps.py": 31,
    "test_family_deepseek.py": 28,
    "test_restart_async.py": 27,
    "test_multinode.py": 25,
    "test_gpu_check_script.py": 25,
    "test_rollout_native.py": 20,
}


def pytest_configure(config):
    # pytest-xdist >= 3.8 (pyproject's test extra): keep the order set below under --dist loadfile
    if hasattr(config.option, "loadscopereorder"):  # absent when run with -p no:xdist
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The long files first (stable: the rest keep their order), so the run ends on short ones."""
    items.sort(key=lambda item: -_LONG_FILES.get(item.path.name, 0))


@pytest.fixture(scope="session")
def pool1():
    """One process in its own gloo group: the single-process reference."""
    from verl_megatron.distributed.dist_pool import DistPool

    pool = DistPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    """Two processes in one gloo group: every CPU-capable parallel layout of size 2."""
    from verl_megatron.distributed.dist_pool import DistPool

    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.fixture
def no_runtime(monkeypatch):
    """Fail the test if training gets as far as starting the process group."""
    import verl_megatron.distributed.parallel as parallel

    def refuse(*args, **kwargs):
        raise AssertionError("init_runtime reached: the error was not caught before the expensive work")

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(parallel, "init_runtime", refuse)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """The tiny Llama of tests/test_actor_update.py (``build_hf_model``), saved once per module."""
    from tests.helpers import saved_model
    from tests.test_actor_update import build_hf_model

    return saved_model(tmp_path_factory, "tiny_llama", build_hf_model)
