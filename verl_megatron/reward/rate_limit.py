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
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["AsyncTokenBucket", "PerLoop"]

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
