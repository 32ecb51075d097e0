"""An asyncio token bucket: a rate limit that allows bursts (verl's ``AsyncTokenBucket``).

The bucket holds at most ``max_tokens`` and refills at ``rate_limit`` tokens per second; it
starts full. ``await acquire(n)`` takes n tokens, sleeping until the refill covers them. A
request larger than the bucket can never be covered by waiting for a full bucket, so it takes
what is there, waits out the deficit at the refill rate, and leaves the balance negative:
the next callers wait until the debt is repaid. Used to keep API-judged rewards under a
provider's requests-per-minute and tokens-per-minute quotas.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["AsyncTokenBucket", "PerLoop", "ThreadSlots"]

_T = TypeVar("_T")


class PerLoop(Generic[_T]):
    """One ``factory()`` object per running event loop, made there on first use: an asyncio
    lock or semaphore binds to the loop that first waits on it, and each ``asyncio.run``
    is a new loop (a shared one raised 'bound to a different event loop' in the second)."""

    def __init__(self, factory: Callable[[], _T]) -> None:
        self._factory = factory
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _T] = weakref.WeakKeyDictionary()

    def get(self) -> _T:
        loop = asyncio.get_running_loop()
        made = self._by_loop.get(loop)
        if made is None:
            made = self._by_loop[loop] = self._factory()
        return made


class ThreadSlots:
    """At most `limit` slots taken at once, process-wide: across threads and event loops.

    A blocking call run in a thread of its own takes a slot before the thread starts and the
    thread gives it back when the call returns, also after the awaiting coroutine gave up on
    it (a timeout): a thread cannot be stopped, so it counts as in flight until it ends. An
    asyncio semaphore cannot bound that: it belongs to one loop (each ``asyncio.run`` is a
    new one) and its holder's cancellation frees the slot while the thread runs on.

    ``await acquire()`` waits, first come first served, for a free slot; ``release()`` may be
    called from any thread and hands the slot straight to the oldest waiter.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"ThreadSlots: limit must be >= 1, got {limit}")
        self.limit = limit
        self._taken = 0
        self._released = 0  # slots given back so far: a waiter sees whether the queue moves
        self._lock = threading.Lock()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def taken(self) -> int:
        """Slots taken now (including those handed to a waiter that has not resumed yet)."""
        return self._taken

    async def acquire(self, stale_s: float | None = None) -> bool:
        """Take a slot, waiting for one: True. False (no slot taken) when no slot came free for
        `stale_s` seconds: the holders hang, while a queue that moves is waited out however
        long. Cancellable (a timeout) without losing a slot."""
        with self._lock:
            if self._taken < self.limit and not self._waiters:
                self._taken += 1
                return True
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            seen = self._released
        try:
            while not (await asyncio.wait({waiter}, timeout=stale_s))[0]:
                with self._lock:
                    if self._released == seen and waiter in self._waiters:
                        self._waiters.remove(waiter)
                        return False
                    seen = self._released  # a slot came free meanwhile: the queue moves
            return True
        except asyncio.CancelledError:
            waiter.cancel()  # `asyncio.wait` leaves it pending: a hand-over on its way is passed on
            with self._lock:
                queued = waiter in self._waiters
                if queued:
                    self._waiters.remove(waiter)
            # Handed over already: a cancelled future is passed on by `_grant`; one granted
            # before the cancellation reached this task is ours to give back.
            if not queued and waiter.done() and not waiter.cancelled():
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest waiter whose loop still runs, else to the pool."""
        with self._lock:
            self._released += 1
            while self._waiters:
                waiter = self._waiters.popleft()
                try:
                    waiter.get_loop().call_soon_threadsafe(self._grant, waiter)
                    return
                except RuntimeError:  # its loop has closed: nobody waits there any more
                    continue
            self._taken -= 1

    def _grant(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():  # its call timed out between the hand-over and now
            self.release()
        else:
            waiter.set_result(None)


class AsyncTokenBucket:
    """`rate_limit` tokens per second, at most `max_tokens` (default: `rate_limit`) in store.

    Attributes: ``tokens`` (the balance now), ``last_update`` (event-loop time of the last
    refill; None before the first acquire), ``lock`` (serialises the balance's updates; one
    per event loop, see :class:`PerLoop`).
    """

    def __init__(self, rate_limit: float, max_tokens: float | None = None) -> None:
        if rate_limit <= 0:
            raise ValueError(f"AsyncTokenBucket: rate_limit must be > 0, got {rate_limit}")
        self.rate_limit = float(rate_limit)
        self.max_tokens = float(max_tokens or rate_limit)
        self.tokens = self.max_tokens
        self.last_update: float | None = None
        self._locks: PerLoop[asyncio.Lock] = PerLoop(asyncio.Lock)

    @property
    def lock(self) -> asyncio.Lock:
        """The running event loop's lock."""
        return self._locks.get()

    def _refill(self) -> None:
        now = asyncio.get_running_loop().time()
        if self.last_update is not None:
            self.tokens = min(self.max_tokens, self.tokens + (now - self.last_update) * self.rate_limit)
        self.last_update = now

    async def acquire(self, num_tokens: float = 1.0) -> None:
        """Take `num_tokens` (may be fractional), waiting as long as the refill needs."""
        if num_tokens > self.max_tokens:
            async with self.lock:
                self._refill()
                deficit = num_tokens - self.tokens
                self.tokens -= num_tokens  # negative: later callers wait for the debt
            if deficit > 0:
                await asyncio.sleep(deficit / self.rate_limit)
            return
        while True:
            async with self.lock:  # released while sleeping, so others can refill and take
                self._refill()
                if self.tokens >= num_tokens:
                    self.tokens -= num_tokens
                    return
                wait = (num_tokens - self.tokens) / self.rate_limit
            await asyncio.sleep(wait)
