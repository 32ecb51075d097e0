"""DAPO's reward manager: the score plus a soft penalty for overlong responses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verl_megatron.errors import VerlCompatError
from verl_megatron.reward.managers.base import RewardManagerBase, Sample
from verl_megatron.reward.managers.registry import register
from verl_megatron.reward.managers.scoring import DEFAULT_TIMEOUT_S, ScoreOutcome


def _field(cfg: Any, name: str, default: Any = None) -> Any:
    # overlong_buffer_cfg arrives as a DictConfig, a dict or a dataclass.
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def overlong_penalty(
    valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """DAPO's soft overlong punishment, <= 0.

    Responses up to ``max_resp_len - buffer_len`` tokens are free; past that
    the penalty grows linearly and reaches ``-penalty_factor`` at
    ``max_resp_len`` tokens: ``min(-(L - expected) / buffer_len * factor, 0)``.
    """
    exceed = valid_response_length - (max_resp_len - buffer_len)
    return min(-exceed / buffer_len * penalty_factor, 0.0)


@register("dapo")
class DAPORewardManager(RewardManagerBase):
    """Like NaiveRewardManager, with the overlong penalty added to each score.

    As verl's: the decoded response loses a trailing eos string (a tokenizer whose eos
    is not a special token keeps it through skip_special_tokens, and scorers would see
    it), and a scorer returning a plain number has it logged as ``acc``.

    ``overlong_buffer_cfg`` has ``enable``, ``len`` (buffer length in tokens),
    ``penalty_factor`` and ``log`` (add ``overlong_reward`` and ``overlong``
    to reward_extra_info). None disables the penalty (verl crashes there).
    """

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int,
        compute_score: Callable[..., Any] | None = None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        compute_score_timeout: float | None = DEFAULT_TIMEOUT_S,
        isolation: str = "auto",
    ) -> None:
        super().__init__(
            tokenizer, num_examine, compute_score, reward_fn_key, compute_score_timeout, isolation
        )
        self.max_resp_len = max_resp_len
        self.overlong_buffer_cfg = overlong_buffer_cfg
        self.overlong_enabled = bool(
            overlong_buffer_cfg is not None and _field(overlong_buffer_cfg, "enable", False)
        )
        if not self.overlong_enabled:
            return
        self.buffer_len = _field(overlong_buffer_cfg, "len")
        self.penalty_factor = float(_field(overlong_buffer_cfg, "penalty_factor", 1.0))
        self.log_overlong = bool(_field(overlong_buffer_cfg, "log", False))
        # VerlCompatError is also an AssertionError: verl asserts these three.
        if max_resp_len is None:
            raise VerlCompatError(
                "DAPORewardManager: max_resp_len must be provided when overlong_buffer_cfg.enable is set, got None"
            )
        if not isinstance(self.buffer_len, int) or self.buffer_len <= 0:
            raise VerlCompatError(
                f"DAPORewardManager: overlong_buffer_cfg.len must be a positive int, got {self.buffer_len!r}"
            )
        if self.buffer_len > max_resp_len:
            raise VerlCompatError(
                f"DAPORewardManager: max_resp_len must be larger than overlong_buffer.len "
                f"({max_resp_len} < {self.buffer_len}): every response would be penalised"
            )

    def _decode_many(self, id_lists: list[list[int]]) -> list[str]:
        texts = super()._decode_many(id_lists)
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos:
            return texts
        return [text[: -len(eos)] if text.endswith(eos) else text for text in texts]

    def _score(self, samples: list[Sample]) -> list[ScoreOutcome]:
        outcomes = super()._score(samples)
        # A plain-number score is logged as "acc"; a dict score logs its own keys.
        return [
            outcome if outcome.info is not None else dataclasses.replace(outcome, info={"acc": outcome.score})
            for outcome in outcomes
        ]

    def _adjust(self, sample: Sample, score: float) -> tuple[float, dict[str, Any]]:
        if not self.overlong_enabled:
            return score, {}
        penalty = overlong_penalty(
            sample.valid_response_length, self.max_resp_len, self.buffer_len, self.penalty_factor
        )
        logged = {"overlong_reward": penalty, "overlong": penalty < 0} if self.log_overlong else {}
        return score + penalty, logged
