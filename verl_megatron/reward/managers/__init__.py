"""Reward managers: turn a batch of responses into per-token rewards.

Pick one by name with :func:`get_reward_manager_cls` ("naive", "dapo",
"batch", "parallel", "prime"); add your own with ``@register("name")``.
"""

# Imported for their @register side effect; the registry is filled on import.
from verl_megatron.reward.managers.agent import AgentRewardManager
from verl_megatron.reward.managers.base import RewardManagerBase
from verl_megatron.reward.managers.batch import BatchRewardManager
from verl_megatron.reward.managers.dapo import DAPORewardManager
from verl_megatron.reward.managers.naive import NaiveRewardManager
from verl_megatron.reward.managers.parallel import ParallelRewardManager, PrimeRewardManager
from verl_megatron.reward.managers.registry import (
    REWARD_MANAGER_REGISTRY,
    get_reward_manager_cls,
    register,
)

__all__ = [
    "REWARD_MANAGER_REGISTRY",
    "AgentRewardManager",
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "ParallelRewardManager",
    "PrimeRewardManager",
    "RewardManagerBase",
    "get_reward_manager_cls",
    "register",
]
