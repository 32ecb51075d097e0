"""The scorer process pool: chunked dispatch, hard kills, and result checks."""

import math
import os
import threading
import time

import numpy as np
import pytest
import torch
from verl_megatron.workers.reward_manager.scoring import (
    ERROR,
    INVALID,
    OK,
    TIMEOUT,
    ScorerPool,
    ScoreTask,
    call_contained,
    coerce_result,
)


def scorer(x):
    if x == 2:
        time.sleep(60)
    if x == 7:
        os._exit(3)
    if x == 9:
        return threading.Lock()  # cannot be pickled back to the parent
    if x == 11:
        raise KeyError("missing")
    return x * 10.0


def test_chunked_pool_requeues_calls_behind_a_killed_one():
    # 20 tasks on one worker go out in chunks of 5: the hang at 2 and the exit at 7
    # each kill the worker while later calls of their chunk are still queued.
    pool = ScorerPool(scorer, num_workers=1, timeout=0.5)
    outcomes = pool.map([ScoreTask({"x": x}) for x in range(20)])
    statuses = [o.status for o in outcomes]
    expected = [OK] * 20
    expected[2], expected[7], expected[9], expected[11] = TIMEOUT, ERROR, ERROR, ERROR
    assert statuses == expected
    assert [o.score for o in outcomes] == [0.0 if s != OK else x * 10.0 for x, s in enumerate(expected)]
    assert outcomes[2].message == "scorer did not return within 0.5 s (worker process killed)"
    assert outcomes[7].message == "scorer process died (exit code 3)"
    assert outcomes[9].message.startswith("scorer result cannot be sent between processes")
    assert outcomes[11].message == "KeyError: 'missing'"
    assert len(pool._workers) == 1
    pool.close()
    assert pool._workers == []


def test_killed_worker_is_gone_and_replaced():
    pool = ScorerPool(scorer, num_workers=2, timeout=0.3)
    assert [o.score for o in pool.map([ScoreTask({"x": 1}), ScoreTask({"x": 3})])] == [10.0, 30.0]
    before = {w.process.pid: w.process for w in pool._workers}
    outcomes = pool.map([ScoreTask({"x": 2}), ScoreTask({"x": 4})])
    assert [o.status for o in outcomes] == [TIMEOUT, OK]
    dead = [proc for pid, proc in before.items() if pid not in {w.process.pid for w in pool._workers}]
    assert len(dead) == 1 and not dead[0].is_alive() and dead[0].exitcode == -9  # SIGKILL
    assert len(pool._workers) == 2
    pool.close()


def test_pool_without_timeout_and_invalid_arguments():
    pool = ScorerPool(scorer, num_workers=2)
    assert [o.score for o in pool.map([ScoreTask({"x": x}) for x in (1, 3, 4)])] == [10.0, 30.0, 40.0]
    assert pool.map([]) == []
    pool.close()
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        ScorerPool(scorer, num_workers=0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds or None, got -1"):
        ScorerPool(scorer, timeout=-1)


def test_spawn_worker_that_cannot_load_the_scorer_fails_clearly():
    pool = ScorerPool(lambda x: x, num_workers=1, start_method="spawn")
    with pytest.raises(
        RuntimeError,
        match=r"cannot start a 'spawn' reward scorer worker .*Can't pickle local object.*Use a module-level function",
    ):
        pool.map([ScoreTask({"x": 1})])
    pool.close()


@pytest.mark.parametrize(
    ("value", "status", "score"),
    [
        (1, OK, 1.0),
        (True, OK, 1.0),
        (np.float32(0.25), OK, 0.25),
        (np.array(0.5), OK, 0.5),
        (torch.tensor(-2.0), OK, -2.0),
        ({"score": 3, "acc": True}, OK, 3.0),
        (math.nan, INVALID, 0.0),
        (math.inf, INVALID, 0.0),
        ({"score": math.nan}, INVALID, 0.0),
        ({"acc": 1.0}, INVALID, 0.0),
        ("0.5", INVALID, 0.0),
        (None, INVALID, 0.0),
        ([1.0], INVALID, 0.0),
        (torch.tensor([1.0, 2.0]), INVALID, 0.0),
    ],
)
def test_coerce_result(value, status, score):
    outcome = coerce_result(value)
    assert (outcome.status, outcome.score) == (status, score)
    assert type(outcome.score) is float


def test_call_contained_turns_exceptions_into_errors():
    def boom(**kwargs):
        raise ValueError(f"bad {kwargs['x']}")

    outcome = call_contained(boom, {"x": 3})
    assert (outcome.status, outcome.score, outcome.message) == (ERROR, 0.0, "ValueError: bad 3")
