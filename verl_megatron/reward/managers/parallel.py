"""Reward managers that score samples concurrently in a process pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from verl_megatron.reward.managers.base import RewardManagerBase, Sample
from verl_megatron.reward.managers.registry import register
from verl_megatron.reward.managers.scoring import DEFAULT_TIMEOUT_S, ScoreOutcome


@register("parallel")
class ParallelRewardManager(RewardManagerBase):
    """Scores samples in ``num_processes`` worker processes at once.

    Each call has a hard time limit (``compute_score_timeout``, default
    30 s; None for none), built-in scorers included. Workers start on the
    first call and are reused; hung calls do not hold up the others.
    ``mp_start_method`` is "fork" by default (fast, no pickling of the
    scorer); use "spawn" to keep workers clear of the parent's state.
    ``num_processes=None`` takes ``DEFAULT_NUM_PROCESSES`` (None there: the CPU count, at most 8).
    """

    DEFAULT_NUM_PROCESSES: int | None = None

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        num_processes: int | None = None,
        compute_score_timeout: float | None = DEFAULT_TIMEOUT_S,
        mp_start_method: str | None = None,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, compute_score_timeout)
        if num_processes is None:
            num_processes = self.DEFAULT_NUM_PROCESSES or min(8, os.cpu_count() or 1)
        self.num_processes = num_processes
        if self.num_processes < 1:
            raise ValueError(f"{type(self).__name__}: num_processes must be >= 1, got {num_processes}")
        self.mp_start_method = mp_start_method

    def _score(self, samples: list[Sample]) -> list[ScoreOutcome]:
        pool = self._get_pool(self.num_processes, self.mp_start_method)
        return pool.map([self._task(sample) for sample in samples])


@register("prime")
class PrimeRewardManager(ParallelRewardManager):
    """verl's name for the process-pool manager (PRIME), with its 64 processes by default."""

    # verl's PRIME scores with 64 processes unless told otherwise.
    DEFAULT_NUM_PROCESSES = 64
