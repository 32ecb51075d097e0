"""The sequential reward manager: one ``compute_score`` call per sample."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from verl_megatron.reward.managers.base import RewardManagerBase
from verl_megatron.reward.managers.registry import register


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
