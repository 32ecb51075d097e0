"""Scoring a generated batch: the rule reward on rank 0 (broadcast to every rank, so a slow or
random scorer cannot split the ranks), combined with the reward model's and the judge's scores
when they are enabled, then stored in the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.protocol import DataProto
from verl_megatron.reward.loading import compute_reward
from verl_megatron.trainer.components import RewardFn

if TYPE_CHECKING:
    from verl_megatron.reward.model_rewards import ModelRewards

__all__ = ["BatchScorer", "combined_reward", "rule_reward", "store_scores"]

Reward = tuple[torch.Tensor, dict[str, list[Any]]]
"""(reward [B, Tr], per-sample extra info)."""


def rule_reward(batch: DataProto, reward_fn: RewardFn, runtime: Runtime) -> Reward:
    """(reward [B, Tr], extra info) computed on rank 0 and broadcast to every rank."""
    if runtime.world_size == 1:
        return compute_reward(batch, reward_fn)
    payload: list[Any] = [None]
    if runtime.is_main:
        try:
            payload[0] = ("ok", compute_reward(batch, reward_fn))
        except Exception as err:  # every rank must leave the broadcast, then raise together
            payload[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise RuntimeError(f"reward computation failed on rank 0: {value}")
    return value


def combined_reward(
    batch: DataProto, reward_fn: RewardFn, runtime: Runtime, model_rewards: ModelRewards | None
) -> Reward:
    """(reward [B, Tr], extra info): the rule reward, combined with the reward model's and the
    judge's scores when they are enabled (``reward_model.combine``)."""
    if model_rewards is None:
        return rule_reward(batch, reward_fn, runtime)
    rule = rule_reward(batch, reward_fn, runtime) if model_rewards.uses_rule else None
    return model_rewards.apply(batch, rule)


def store_scores(batch: DataProto, reward: torch.Tensor, extra: dict[str, list[Any]]) -> dict[str, float]:
    """Put the reward into ``token_level_scores`` and the per-sample extra info into non-tensors.

    Returns the batch's counts of contained scorer failures (``reward/timeout_count``,
    ``reward/error_count``, ``reward/invalid_count``: per-sample 0/1 in the extra info).
    """
    batch.batch["token_level_scores"] = reward
    counts: dict[str, float] = {}
    for key, values in extra.items():
        if len(values) == len(batch):
            batch.non_tensor_batch[key] = np.array(values, dtype=object)
        if key.startswith("reward/") and key.endswith("_count"):
            counts[key] = float(np.sum(np.asarray(values, dtype=np.float64)))
    return counts


@dataclass(frozen=True)
class BatchScorer:
    """Scores a training batch in place; returns its scorer-failure counts (a ``ScoreFn``)."""

    reward_fn: RewardFn
    runtime: Runtime
    model_rewards: ModelRewards | None

    def __call__(self, batch: DataProto) -> dict[str, float]:
        return store_scores(batch, *combined_reward(batch, self.reward_fn, self.runtime, self.model_rewards))
