"""verl's ``experimental.reward_loop.reward_manager.limited``: the token bucket and the
rate-limited reward manager (see :mod:`verl_megatron.reward.managers.rate_limited`)."""

from verl_megatron.reward.managers.rate_limited import RateLimitedRewardManager
from verl_megatron.reward.rate_limit import AsyncTokenBucket

__all__ = ["AsyncTokenBucket", "RateLimitedRewardManager"]
