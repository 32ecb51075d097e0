"""The sequential reward manager: one ``compute_score`` call per sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_megatron.workers.reward_manager.base import RewardManagerBase
from verl_megatron.workers.reward_manager.registry import register


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """Scores samples one after another.

    Without ``compute_score_timeout`` the scorer runs in this process (an
    exception still only zeroes its sample); with it, each call runs in a
    worker process that is killed when the call overruns.
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = None,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, compute_score_timeout)
