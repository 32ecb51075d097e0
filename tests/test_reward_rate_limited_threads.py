"""RateLimitedRewardManager's ``max_concurrent`` bounds the blocking scorer calls really running,
also those a ``timeout`` abandoned: their threads run on, so they keep their slot until they end."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from tests.test_reward_review_ratelimit import _batch, _Tok


class _CountingScorer:
    """A blocking scorer that counts the calls running at once (and their peak) under a lock;
    each call blocks until `release` is set or `hold` seconds pass."""

    def __init__(self, hold: float) -> None:
        self.hold, self.release = hold, threading.Event()
        self.lock = threading.Lock()
        self.running = self.peak = self.started = 0

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None) -> float:
        with self.lock:
            self.running += 1
            self.started += 1
            self.peak = max(self.peak, self.running)
        try:
            self.release.wait(timeout=self.hold)
            return 1.0
        finally:
            with self.lock:
                self.running -= 1

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.running == 0:
                    return True
            time.sleep(0.01)
        return False


@pytest.fixture
def make_manager():
    """Builds a manager whose class limits are made afresh (they are per process)."""
    from verl_megatron.reward.managers.rate_limited import RateLimitedRewardManager

    def make(scorer: _CountingScorer, max_concurrent: int, timeout: float) -> RateLimitedRewardManager:
        RateLimitedRewardManager._class_initialized = False
        return RateLimitedRewardManager(
            {"reward": {"max_concurrent": max_concurrent, "timeout": timeout}}, _Tok(), scorer
        )

    yield make
    RateLimitedRewardManager._class_initialized = False


def _assert_all_timed_out(out, size: int) -> None:
    assert out["reward_extra_info"] == {"acc": [0.0] * size, "timeout": [True] * size}
    assert out["reward_tensor"].abs().sum().item() == 0.0


def test_timed_out_scorer_threads_keep_their_slot(make_manager):
    # Each call blocks until the step has returned, against a 0.1 s timeout: the first two are
    # cut off at 0.1 s and run on; the next four wait for a slot in vain and time out.
    scorer = _CountingScorer(hold=10.0)
    manager = make_manager(scorer, 2, 0.1)
    out = manager(_batch(6), return_dict=True)
    scorer.release.set()
    assert scorer.wait_idle(5.0)
    _assert_all_timed_out(out, 6)
    assert scorer.peak <= 2, f"{scorer.peak} scorer calls ran at once with max_concurrent=2"
    assert scorer.started == 2  # the four later calls timed out waiting, without a thread
    assert manager._scorer_threads.taken == 0  # every finished thread gave its slot back


def test_scorer_threads_that_never_finish_stay_bounded(make_manager):
    # Calls that never return (until the test ends) hold both slots across steps (each step
    # is a new event loop): later calls time out waiting instead of starting more threads.
    scorer = _CountingScorer(hold=30.0)
    manager = make_manager(scorer, 2, 0.05)
    try:
        for _ in range(3):
            _assert_all_timed_out(manager(_batch(4), return_dict=True), 4)
        assert (scorer.started, scorer.peak) == (2, 2)
        assert manager._scorer_threads.taken == 2
    finally:
        scorer.release.set()
    assert scorer.wait_idle(5.0)
    assert manager._scorer_threads.taken == 0


def test_slots_return_after_abandoned_threads_end(make_manager):
    scorer = _CountingScorer(hold=10.0)
    manager = make_manager(scorer, 1, 0.05)
    _assert_all_timed_out(manager(_batch(2), return_dict=True), 2)
    scorer.release.set()  # the abandoned call ends, and from now on each call returns at once
    assert scorer.wait_idle(5.0)
    out = manager(_batch(2), return_dict=True)
    assert out["reward_tensor"][:, -1].tolist() == [1.0, 1.0]
    assert (scorer.started, scorer.peak) == (3, 1)


def test_max_concurrent_below_one_is_refused(make_manager):
    with pytest.raises(ValueError, match=r"reward\.max_concurrent must be an integer >= 1, got 0"):
        make_manager(_CountingScorer(hold=0.0), 0, 1.0)


def test_slot_handed_to_a_waiter_that_times_out_is_not_lost():
    from verl_megatron.reward.rate_limit import ThreadSlots

    async def scenario() -> list[int]:
        slots = ThreadSlots(1)
        await slots.acquire()
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)  # the waiter queues
        slots.release()  # hands the slot to the waiter (on the loop's next turn)...
        waiter.cancel()  # ...which its timeout cancels first
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)  # the hand-over runs and finds nobody
        taken = [slots.taken]
        await asyncio.wait_for(slots.acquire(), timeout=1.0)  # the slot is free again
        return [*taken, slots.taken]

    assert asyncio.run(scenario()) == [0, 1]


@pytest.fixture
def manager_cls():
    """The class with its shared rate buckets made afresh, and not reset between its managers."""
    from verl_megatron.reward.managers.rate_limited import RateLimitedRewardManager

    RateLimitedRewardManager._class_initialized = False
    yield RateLimitedRewardManager
    RateLimitedRewardManager._class_initialized = False


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_concurrent", 0, "reward.max_concurrent must be an integer >= 1, got 0"),
        ("max_rpm", 0, "reward.max_rpm must be a number > 0 or null, got 0"),
        ("timeout", -1, "reward.timeout must be a number > 0 or null, got -1"),
    ],
)
def test_a_later_managers_limits_are_checked_too(manager_cls, key, value, message):
    manager_cls({"reward": {"max_concurrent": 4}}, _Tok(), _CountingScorer(hold=0.0))
    with pytest.raises(ValueError) as err:
        manager_cls({"reward": {key: value}}, _Tok(), _CountingScorer(hold=0.0))
    assert str(err.value) == message


def test_each_manager_is_bounded_by_its_own_max_concurrent(manager_cls):
    peaks = {}
    for limit in (1, 3):  # the first manager's 1 used to bound the second one too
        scorer = _CountingScorer(hold=0.5)
        manager = manager_cls({"reward": {"max_concurrent": limit, "timeout": 30.0}}, _Tok(), scorer)
        out = manager(_batch(6), return_dict=True)
        assert out["reward_tensor"][:, -1].tolist() == [1.0] * 6
        peaks[limit] = scorer.peak
    assert peaks == {1: 1, 3: 3}


def test_a_queue_longer_than_the_timeout_is_waited_out(manager_cls):
    # One slot, five calls of 0.1 s, a 0.3 s timeout: the slot keeps coming free, so the last
    # call waits 0.4 s for it and still scores (the timeout bounds a call, not the queue).
    scorer = _CountingScorer(hold=0.1)
    manager = manager_cls({"reward": {"max_concurrent": 1, "timeout": 0.3}}, _Tok(), scorer)
    out = manager(_batch(5), return_dict=True)
    assert out["reward_tensor"][:, -1].tolist() == [1.0] * 5
    assert (scorer.started, scorer.peak) == (5, 1)
