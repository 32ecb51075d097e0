"""The sequential reward manager: one ``compute_score`` call per sample."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from verl_megatron.reward.managers.base import RewardManagerBase
from verl_megatron.reward.managers.registry import register
from verl_megatron.reward.managers.scoring import DEFAULT_TIMEOUT_S


@contextlib.contextmanager
def _score_timeout(seconds: float | None) -> Iterator[None]:
    """Raise TimeoutError in the block after ``seconds`` (verl's in-process guard; None or 0: none).

    A SIGALRM timer, so only in the main thread and only for Python code that returns to the
    interpreter; the managers' own limit (``compute_score_timeout``) kills a worker process
    instead, which also stops C loops, exits and crashes. Kept for code written against verl.
    """
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _alarm(signum, frame):
        raise TimeoutError(f"compute_score exceeded {seconds} s")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """Scores samples one after another: a user's scorer in one worker process
    (killed and replaced when a call overruns ``compute_score_timeout``; hung
    calls are waited on side by side), a built-in one in this process. See
    :mod:`~verl_megatron.reward.managers.base` for ``isolation``.
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = DEFAULT_TIMEOUT_S,
        isolation: str = "auto",
    ) -> None:
        super().__init__(
            tokenizer, num_examine, compute_score, reward_fn_key, compute_score_timeout, isolation
        )
