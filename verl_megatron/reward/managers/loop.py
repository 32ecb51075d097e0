"""The interface of verl's per-sample reward-loop managers
(``experimental.reward_loop.reward_manager``): built from the whole config, scoring the last
sample of a DataProto per awaited ``run_single`` call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["RewardLoopManager"]


class RewardLoopManager:
    """Holds what every reward-loop manager is built from: the trainer config, the policy's
    tokenizer, the scorer, and a reward-model router with its tokenizer (None without one)."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer

    async def run_single(self, data: Any) -> dict[str, Any]:
        """{"reward_score": float, "reward_extra_info": dict} of the last sample of `data`."""
        raise NotImplementedError
