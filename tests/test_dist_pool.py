"""DistPool.run waits on every rank under one deadline and reports the first failure at once.

A rank that raises while its peer waits in a collective used to be polled after the peer, with
the whole timeout: the call waited it out, raised "rank 1 did not finish" without rank 0's error,
and the pool then returned [] for every later job.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from verl_megatron.distributed.dist_pool import DistPool


def rank_job() -> int:
    return dist.get_rank()


def raise_on_rank0_job() -> int:
    if dist.get_rank() == 0:
        raise ValueError("rank zero's own failure")
    dist.all_reduce(torch.zeros(1))  # rank 1 waits for rank 0, which never comes
    return 1


def raise_everywhere_job() -> int:
    raise ValueError(f"failure number {dist.get_rank()}")


def test_a_rank_that_raises_while_its_peer_hangs_is_reported_at_once_and_closes_the_pool():
    pool = DistPool(2)
    try:
        assert pool.run(f"{__name__}:rank_job") == [0, 1]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="ValueError: rank zero's own failure") as failed:
            pool.run(f"{__name__}:raise_on_rank0_job", timeout_s=60)
        elapsed = time.monotonic() - start
        assert elapsed < 25, elapsed  # the straggler grace (10 s), not the 60 s timeout
        assert "rank 1 had not finished when the wait ended" in str(failed.value)
        # The hung rank was killed with the pool: a later job says so instead of returning [].
        with pytest.raises(RuntimeError, match="the pool is closed"):
            pool.run(f"{__name__}:rank_job")
    finally:
        pool.close(force=True)


def test_errors_of_every_rank_are_reported_and_the_pool_stays_usable():
    pool = DistPool(2)
    try:
        with pytest.raises(RuntimeError) as failed:
            pool.run(f"{__name__}:raise_everywhere_job", timeout_s=60)
        assert "failure number 0" in str(failed.value) and "failure number 1" in str(failed.value)
        assert pool.run(f"{__name__}:rank_job") == [0, 1]
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.run(f"{__name__}:rank_job")


def fork_a_pool_job() -> str:
    from verl_megatron.distributed.dist_pool import DistPool

    try:
        DistPool(1, start_method="fork").close()
    except ValueError as err:
        return str(err)
    return "forked"


def test_a_pool_is_not_forked_from_a_process_that_has_a_process_group(pool1):
    """Each forked worker would inherit the caller's group and then form its own over it."""
    assert pool1.run(f"{__name__}:fork_a_pool_job") == [
        "DistPool(start_method='fork') from a process that has a process group: use 'spawn'"
    ]
