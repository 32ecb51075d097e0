"""Timeouts the trainer waits out without progress, against the stall watchdog's.

While the trainer waits for a scorer call, an environment's worker process or an API-bound
judge (sleeping, waiting on I/O), nothing counts as progress (``distributed/watchdog.py``): a
limit at or above ``trainer.stall_timeout_s`` never fires, the watchdog ends the whole job
first. ``rollout.agent.deadline_s`` is not among them: it bounds a whole batch, mostly spent
generating (progress), so it says nothing of the longest wait; the endpoint's idle polling
(``serve``: ~13 ms of CPU a second, the watchdog counting 10) is no reliable progress either, so
a harness waiting silently for longer than the stall timeout still ends the job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.reward.loading import resolve_reward_manager_cls
from verl_megatron.reward.managers.rate_limited import DEFAULT_TIMEOUT_S, RateLimitedRewardManager

__all__ = ["check_stall_timeouts"]


def _mapping(node: Any) -> Any:
    return node if isinstance(node, dict) else {}


def _waits(config: Any) -> Iterator[tuple[str, Any, str]]:
    """(key, seconds, what is waited for) of each limit the configuration turns on."""
    reward_kwargs = config.reward_model.reward_kwargs
    yield (
        "reward_model.reward_kwargs.compute_score_timeout",
        reward_kwargs.get("compute_score_timeout"),
        "a scorer call",
    )
    multi_turn = config.rollout.multi_turn
    if multi_turn.enable and multi_turn.isolation == "process":
        yield "rollout.multi_turn.env_timeout_s", multi_turn.env_timeout_s, "an environment call"
    manager_cls = resolve_reward_manager_cls(config.reward_model.reward_manager)
    if isinstance(manager_cls, type) and issubclass(manager_cls, RateLimitedRewardManager):
        section = _mapping(_mapping(reward_kwargs.get("config")).get("reward"))
        timeout = section.get("timeout", DEFAULT_TIMEOUT_S)
        yield "reward_model.reward_kwargs.config.reward.timeout", timeout, "an API-bound scorer call"


def check_stall_timeouts(config: Any) -> None:
    """A ConfigError naming the first such limit at or above ``trainer.stall_timeout_s`` (> 0)."""
    stall_s = config.trainer.stall_timeout_s
    if stall_s <= 0:  # the watchdog is off: nothing ends a long wait early
        return
    for key, value, what in _waits(config):
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= stall_s:
            raise ConfigError(
                f"{key}={value:g} must be below trainer.stall_timeout_s={stall_s:g}: {what} is waited for "
                "without progress, so the watchdog would end the job first"
            )
