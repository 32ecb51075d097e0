"""DAPO reward manager with the interface of verl's reward loop: built from the whole
config (``reward.reward_kwargs.{max_resp_len, overlong_buffer_cfg}``), scoring one
sample per awaited ``run_single`` call. The scoring itself (eos strip, acc, overlong
penalty, the checks) is `workers.reward_manager.dapo.DAPORewardManager`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl_megatron.protocol import DataProto
from verl_megatron.reward.managers.dapo import DAPORewardManager as _BatchDAPO
from verl_megatron.reward.managers.loop import RewardLoopManager

__all__ = ["DAPORewardManager"]


def _reward_kwargs(config: Any) -> Any:
    reward = config.get("reward", {}) if hasattr(config, "get") else getattr(config, "reward", {})
    return reward.get("reward_kwargs", {}) if hasattr(reward, "get") else getattr(reward, "reward_kwargs", {})


class DAPORewardManager(RewardLoopManager):
    """verl reward-loop DAPO manager: ``await run_single(data)`` -> {"reward_score",
    "reward_extra_info"} for the last sample of `data` (a DataProto)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """`RewardLoopManager`'s arguments (config, tokenizer, compute_score, ...)."""
        super().__init__(*args, **kwargs)
        if self.reward_router_address is not None:
            raise ValueError(
                "DAPORewardManager: a reward model router (reward_router_address) is not supported"
            )
        reward_kwargs = _reward_kwargs(self.config)
        self.max_resp_len = reward_kwargs.get("max_resp_len", None)
        self.overlong_buffer_cfg = reward_kwargs.get("overlong_buffer_cfg", None)
        self._manager = _BatchDAPO(
            self.tokenizer,
            num_examine=0,
            compute_score=self.compute_score,
            max_resp_len=self.max_resp_len,
            overlong_buffer_cfg=self.overlong_buffer_cfg,
        )

    async def run_single(self, data: DataProto) -> dict[str, Any]:
        """Score the last sample of `data` in a worker thread (scorers may block)."""
        last = data[len(data) - 1 : len(data)]
        out = await asyncio.to_thread(self._manager, last, True)
        reward = out["reward_tensor"].sum().item()
        extra = {key: values[0] for key, values in out["reward_extra_info"].items() if "/" not in key}
        return {"reward_score": reward, "reward_extra_info": extra}
