"""A per-sample reward manager for scorers that call a rate-limited API (LLM judges): verl's
``RateLimitedRewardManager`` of its reward loop.

Each ``await run_single(data)`` scores the last sample of `data` after passing three limits:
a request-per-minute bucket (1 token per request), a token-per-minute bucket
(``estimated_tokens_per_request`` tokens per request) and a concurrency semaphore, then runs
the scorer under ``timeout`` seconds. A timeout or an exception scores 0 (``acc`` 0, and
``timeout``/``error`` in the extra info) instead of failing the step. A blocking scorer runs in
a thread that a timeout cannot stop; it holds one of the manager's ``max_concurrent`` slots
until it really returns, so at most ``max_concurrent`` of its scorer calls ever run at once
(that is its only gate: a call queues for a slot as long as slots come free, and scores the
timeout when none came free for ``timeout`` seconds).

The limits come from the config's ``reward`` section (``max_concurrent`` 1, ``max_rpm`` and
``max_tpm`` None = unlimited, ``estimated_tokens_per_request`` 2000, ``timeout`` 300 s), checked
for every manager. ``max_concurrent``, ``estimated_tokens_per_request`` and ``timeout`` are the
manager's own. The rpm and tpm buckets belong to the class: an API quota is per process,
however many managers score against it, so the first `init_class` fixes them (verl's
behaviour; a later config with other rates is ignored with a warning).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import torch

from verl_megatron.reward.managers.loop import RewardLoopManager
from verl_megatron.reward.rate_limit import AsyncTokenBucket, PerLoop, ThreadSlots
from verl_megatron.reward.scorers import default_compute_score

__all__ = ["RateLimitedRewardManager"]

logger = logging.getLogger(__name__)


def _section(config: Any) -> Any:
    section = config.get("reward", None) if hasattr(config, "get") else getattr(config, "reward", None)
    return section if section is not None else {}


DEFAULT_TIMEOUT_S = 300.0
"""``reward.timeout`` when the section leaves it out (verl's)."""


def _number(section: Any, key: str, default: Any, integer: bool = False, optional: bool = False) -> Any:
    """``section[key]`` (else `default`), refused with one line unless a number > 0 (an integer
    >= 1 with `integer`; None too with `optional`)."""
    value = section.get(key, default)
    if value is None and optional:
        return None
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < float("inf"):
        wanted = "an integer >= 1" if integer else "a number > 0" + (" or null" if optional else "")
        raise ValueError(f"reward.{key} must be {wanted}, got {value!r}")
    return value


def _bucket(per_minute: float | None) -> AsyncTokenBucket | None:
    """A bucket refilling `per_minute` / 60 per second holding one second's worth, or None."""
    return None if per_minute is None else AsyncTokenBucket(per_minute / 60.0, per_minute / 60.0)


def _in_daemon_thread(call: Callable[[], Any], slots: ThreadSlots) -> asyncio.Future[Any]:
    """``call()`` started now in a daemon thread of its own; its outcome is the future's. The
    caller took one of `slots`, which the thread gives back when the call returns (started
    here, not in a task, so a timeout firing before a task's first step cannot lose it). Unlike the loop's default executor,
    which ``asyncio.run`` joins at its end, a call still running when the ``timeout`` cut it
    off does not hold up the step (nor the interpreter's exit); it runs on until it returns
    (a thread cannot be killed) and its result is dropped, still holding its slot, so
    abandoned calls count against ``max_concurrent``."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(outcome: Any, failed: bool) -> None:
        if not future.done():  # cancelled by the timeout
            (future.set_exception if failed else future.set_result)(outcome)

    def work() -> None:
        try:
            outcome, failed = call(), False
        except BaseException as err:  # handed to the awaiting coroutine
            outcome, failed = err, True
        finally:
            slots.release()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for this result
            loop.call_soon_threadsafe(deliver, outcome, failed)

    try:
        threading.Thread(target=work, name="rate-limited-scorer", daemon=True).start()
    except BaseException:
        slots.release()
        raise
    return future


class RateLimitedRewardManager(RewardLoopManager):
    """``RateLimitedRewardManager(config, tokenizer, compute_score)``; see the module docstring."""

    # The process's API quota, shared by every manager (verl's); the rest is per manager.
    _class_initialized: ClassVar[bool] = False
    _rpm_limiter: ClassVar[AsyncTokenBucket | None] = None
    _max_rpm: ClassVar[float | None] = None
    _tpm_limiter: ClassVar[AsyncTokenBucket | None] = None
    _max_tpm: ClassVar[float | None] = None

    @classmethod
    def init_class(cls, config: Any, tokenizer: Any) -> None:
        """Check ``config.reward``; create the shared rpm / tpm buckets once per process."""
        del tokenizer
        section = _section(config)
        max_rpm = _number(section, "max_rpm", None, optional=True)
        max_tpm = _number(section, "max_tpm", None, optional=True)
        if cls._class_initialized:
            if (section.get("max_rpm", None), section.get("max_tpm", None)) != (cls._max_rpm, cls._max_tpm):
                logger.warning(
                    "RateLimitedRewardManager: the rate limits are shared and already set "
                    "(max_rpm=%s, max_tpm=%s); the new max_rpm=%s, max_tpm=%s are ignored",
                    cls._max_rpm,
                    cls._max_tpm,
                    section.get("max_rpm", None),
                    section.get("max_tpm", None),
                )
            return
        cls._max_rpm, cls._rpm_limiter = max_rpm, _bucket(max_rpm)
        cls._max_tpm, cls._tpm_limiter = max_tpm, _bucket(max_tpm)
        cls._class_initialized = True

    def __init__(
        self, config: Any, tokenizer: Any, compute_score: Callable[..., Any] | None, *args: Any, **kwargs: Any
    ):
        """`RewardLoopManager`'s arguments; verl's batch-manager keywords (num_examine,
        reward_fn_key) are accepted and unused. A missing config means no limits."""
        kwargs.pop("num_examine", None)
        kwargs.pop("reward_fn_key", None)
        if tokenizer is None:
            raise TypeError("RateLimitedRewardManager requires `tokenizer`.")
        config = config if config is not None else {"reward": {}}
        super().__init__(config, tokenizer, compute_score or default_compute_score, *args, **kwargs)
        self.is_async_reward_score = inspect.iscoroutinefunction(self.compute_score)
        section = _section(config)
        self.timeout = _number(section, "timeout", DEFAULT_TIMEOUT_S, optional=True)
        self.max_concurrent = _number(section, "max_concurrent", 1, integer=True)
        self._estimated_tokens_per_request = _number(section, "estimated_tokens_per_request", 2000)
        # Async scorers: a semaphore per event loop. Blocking ones: slots their threads hold
        # across loops (each ``asyncio.run`` is one) until they end, however long.
        self._semaphore = PerLoop(functools.partial(asyncio.Semaphore, self.max_concurrent))
        self._scorer_threads = ThreadSlots(self.max_concurrent)
        type(self).init_class(config, tokenizer)

    def _call_scorer(self, **kwargs: Any) -> Awaitable[Any]:
        if self.reward_router_address is not None:
            kwargs.update(reward_router_address=self.reward_router_address)
            kwargs.update(reward_model_tokenizer=self.reward_model_tokenizer)
        if self.is_async_reward_score:
            return self.compute_score(**kwargs)
        return _in_daemon_thread(functools.partial(self.compute_score, **kwargs), self._scorer_threads)

    @contextlib.asynccontextmanager
    async def _gate(self) -> Any:
        """Yields whether the call may run: the manager's one concurrency gate for its scorer."""
        if self.is_async_reward_score:
            async with self._semaphore.get():
                yield True
        else:  # the thread gives the slot back (_in_daemon_thread)
            yield await self._scorer_threads.acquire(stale_s=self.timeout)

    async def _limited(self, **kwargs: Any) -> tuple[float, dict[str, Any]]:
        if self._rpm_limiter is not None:
            await self._rpm_limiter.acquire(1.0)
        if self._tpm_limiter is not None:
            await self._tpm_limiter.acquire(self._estimated_tokens_per_request)
        async with self._gate() as admitted:
            try:
                if not admitted:  # every slot held by a call that outlived its timeout
                    raise asyncio.TimeoutError
                result = await asyncio.wait_for(self._call_scorer(**kwargs), timeout=self.timeout)
            except asyncio.TimeoutError:
                logger.warning(
                    "reward for data_source=%s timed out after %ss", kwargs["data_source"], self.timeout
                )
                return 0.0, {"timeout": True, "acc": 0.0}
            except Exception as exc:  # one failing API call scores 0 instead of ending the step
                logger.error("reward for data_source=%s failed: %s", kwargs["data_source"], exc)
                return 0.0, {"error": str(exc), "acc": 0.0}
        if isinstance(result, dict):
            return result["score"], dict(result)
        return result, {"acc": result}

    async def run_single(self, data: Any) -> dict[str, Any]:
        """Score the last sample of `data` (a DataProto with ``responses`` [B, Tr] and
        ``attention_mask`` whose last Tr columns mark the response):
        {"reward_score": float, "reward_extra_info": dict}."""
        item = data[len(data) - 1]
        response = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-response.shape[-1] :].sum())
        extra_info = dict(item.non_tensor_batch.get("extra_info", None) or {})
        extra_info.update(item.non_tensor_batch.get("tool_extra_fields", None) or {})
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(
            None, functools.partial(self.tokenizer.decode, response[:valid], skip_special_tokens=True)
        )
        score, extra = await self._limited(
            data_source=item.non_tensor_batch["data_source"],
            solution_str=text,
            ground_truth=item.non_tensor_batch["reward_model"]["ground_truth"],
            extra_info=extra_info,
        )
        return {"reward_score": score, "reward_extra_info": extra}

    def __call__(self, data: Any, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """Score a whole batch (the batch managers' interface): the reward [B, Tr] at each
        row's last valid response token."""

        async def score_all() -> list[dict[str, Any]]:
            return await asyncio.gather(*(self.run_single(data[i : i + 1]) for i in range(len(data))))

        results = asyncio.run(score_all())
        responses = data.batch["responses"]
        valid = data.batch["attention_mask"][:, -responses.shape[-1] :].sum(-1).long()
        reward = torch.zeros(responses.shape, dtype=torch.float32)
        rows = torch.arange(len(data))
        reward[rows, (valid - 1).clamp(min=0)] = torch.tensor([float(r["reward_score"]) for r in results])
        if not return_dict:
            return reward
        keys = {key for r in results for key in r["reward_extra_info"]}
        extra = {key: [r["reward_extra_info"].get(key) for r in results] for key in sorted(keys)}
        return {"reward_tensor": reward, "reward_extra_info": extra}
