"""The sequential reward manager: one ``compute_score`` call per sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_megatron.workers.reward_manager.base import RewardManagerBase
from verl_megatron.workers.reward_manager.registry import register
from verl_megatron.workers.reward_manager.scoring import DEFAULT_TIMEOUT_S


@register("naive")
class NaiveRewardManager(RewardManagerBase):
    """Scores samples one after another: a user's scorer in one worker process
    (killed and replaced when a call overruns ``compute_score_timeout``; hung
    calls are waited on side by side), a built-in one in this process. See
    :mod:`~verl_megatron.workers.reward_manager.base` for ``isolation``.
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
