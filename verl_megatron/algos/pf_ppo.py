"""PF-PPO (arXiv:2409.06957): resample a batch by reward-derived weights before training."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

__all__ = ["PF_PPO_METHODS", "compute_pf_ppo_reweight_data", "pf_ppo_weights"]

PF_PPO_METHODS = ("pow", "max_min", "max_random")
# Keeps every sample drawable: torch.multinomial refuses an all-zero weight vector.
_MIN_WEIGHT = 1e-8


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """Sampling weights [B] from sequence scores [B]: pow = |s|^weight_pow; max_min = 1 for the
    best and worst scores, else 0; max_random = 0.4 for the best score, else 0.1."""
    if reweight_method == "pow":
        return torch.pow(torch.abs(scores), weight_pow)
    if reweight_method == "max_min":
        extreme = (scores == scores.max()) | (scores == scores.min())
        return torch.where(extreme, 1.0, 0.0)
    if reweight_method == "max_random":
        return torch.where(scores == scores.max(), 0.4, 0.1)
    raise ValueError(f"Unsupported reweight_method: {reweight_method!r}; choose one of {PF_PPO_METHODS}")


def compute_pf_ppo_reweight_data(data: Any, reweight_method: str = "pow", weight_pow: float = 2.0) -> Any:
    """A copy of `data` (a DataProto) with B rows drawn with replacement, each row i with
    probability proportional to max(weight_i + 1e-8, 1e-8), where the weights come from the
    sequence scores token_level_scores.sum(-1). Tensors, non-tensor columns and meta_info
    lists of length B are resampled alike; uses torch's global RNG (seed it to reproduce)."""
    scores = data.batch["token_level_scores"].sum(dim=-1)
    weights = torch.clamp(pf_ppo_weights(scores, reweight_method, weight_pow) + _MIN_WEIGHT, min=_MIN_WEIGHT)
    size = scores.shape[0]
    picks = torch.multinomial(weights, size, replacement=True)
    picks_np = picks.cpu().numpy()
    resampled = copy.deepcopy(data)
    resampled.batch = type(data.batch)(
        {key: tensor[picks] for key, tensor in data.batch.items()}, batch_size=data.batch.batch_size
    )
    resampled.non_tensor_batch = {
        key: column[picks_np] if isinstance(column, np.ndarray) else [column[i] for i in picks_np]
        for key, column in data.non_tensor_batch.items()
    }
    resampled.meta_info = {
        key: [value[i] for i in picks_np] if isinstance(value, list) and len(value) == size else value
        for key, value in data.meta_info.items()
    }
    return resampled
