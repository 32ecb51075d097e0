"""Shared fixtures: persistent pools of torch.distributed workers (see verl_megatron.distributed.dist_pool)."""

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
