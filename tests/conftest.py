"""Shared fixtures: persistent pools of torch.distributed workers (see verl_megatron.distributed.dist_pool),
``no_runtime`` for the tests of errors that must be raised before any process group starts, and
``model_path``, the tiny Llama of the actor / critic update tests (a module may define its own)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
