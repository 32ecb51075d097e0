"""The batch reward manager: one vectorised ``compute_score`` call per batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_megatron.reward.managers.base import RewardManagerBase, Sample
from verl_megatron.reward.managers.registry import register
from verl_megatron.reward.managers.scoring import (
    ERROR,
    ScoreOutcome,
    ScoreTask,
    call_contained,
    coerce_result,
)
from verl_megatron.reward.scorers import batch_default_compute_score

# One call scores the whole batch, so its limit is a batch's worth of the per-sample default.
DEFAULT_BATCH_TIMEOUT_S = 600.0


def _keep_raw(value: Any) -> ScoreOutcome:
    return ScoreOutcome(raw=value)


@register("batch")
class BatchRewardManager(RewardManagerBase):
    """Calls ``compute_score(data_sources=..., solution_strs=..., ground_truths=...,
    extra_infos=..., **reward_kwargs)`` once and expects one score (a number
    or a dict with "score") per sample.

    If the call raises, exits, crashes, times out (``compute_score_timeout``
    covers the whole call; default 600 s) or returns the wrong number of
    scores, every sample scores 0 and is counted; each returned score is
    then checked on its own. A user's scorer runs in a worker process, the
    built-in one here (``isolation``, as in the base class).
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = DEFAULT_BATCH_TIMEOUT_S,
        isolation: str = "auto",
        **reward_kwargs: Any,
    ) -> None:
        super().__init__(
            tokenizer,
            num_examine,
            compute_score or batch_default_compute_score,
            reward_fn_key,
            compute_score_timeout,
            isolation,
        )
        self.reward_kwargs = reward_kwargs

    def _score(self, samples: list[Sample]) -> list[ScoreOutcome]:
        kwargs = {
            "data_sources": [s.data_source for s in samples],
            "solution_strs": [s.response_str for s in samples],
            "ground_truths": [s.ground_truth for s in samples],
            "extra_infos": [s.extra_info for s in samples],
            **self.reward_kwargs,
        }
        if not self.isolated:
            call = call_contained(self.compute_score, kwargs, coerce=_keep_raw)
        else:
            call = self._get_pool(num_workers=1).map([ScoreTask(kwargs)], coerce=_keep_raw)[0]
        if call.status != "ok":
            return [ScoreOutcome(0.0, None, call.status, call.message) for _ in samples]
        results = call.raw
        sized = hasattr(results, "__len__") and not isinstance(results, (str, bytes, dict))
        if not sized or len(results) != len(samples):
            got = f"{len(results)} scores" if sized else f"a {type(results).__name__}"
            message = f"batched compute_score returned {got} for {len(samples)} samples"
            return [ScoreOutcome(0.0, None, ERROR, message) for _ in samples]
        return [coerce_result(result) for result in results]
