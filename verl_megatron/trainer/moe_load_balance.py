"""Load balance of a MoE rollout's routing: how evenly the routed (token, top-k) slots of the
response tokens spread over the experts, layer by layer.

Per layer, expert e's share s_e of the slots gives the violation ``s_e * E - 1`` (0: perfectly
balanced; -1: expert unused; E - 1: every slot on it). The trainer logs, per layer, its max, min
and mean absolute value (verl's ``rollout/moe/{max,min,avg}_vio/layer_i``) and their max and
mean over layers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["load_balance_metrics", "moe_load_counts"]

logger = logging.getLogger(__name__)


def moe_load_counts(
    routed_experts: torch.Tensor | None, response_mask: torch.Tensor | None, num_experts: int | None
) -> torch.Tensor | None:
    """[layers, num_experts] counts of the expert ids in `routed_experts` [B, T, layers, top_k]
    (its last Tr positions are the response) over the response tokens of `response_mask`
    [B, Tr]. Each row's last valid response token is left out: it was sampled but never fed
    back through the model, so its slot holds filler, not a routing record. None (and a
    warning where the shapes disagree or an id is out of range) when nothing can be counted."""
    if routed_experts is None or response_mask is None or not num_experts or num_experts <= 0:
        return None
    if (
        routed_experts.dim() != 4
        or response_mask.dim() != 2
        or response_mask.shape[0] != routed_experts.shape[0]
    ):
        logger.warning(
            "rollout MoE metrics: routed_experts %s must be [B, T, layers, top_k] and response_mask %s [B, Tr]",
            tuple(routed_experts.shape),
            tuple(response_mask.shape),
        )
        return None
    width = response_mask.shape[1]
    if width == 0 or routed_experts.shape[1] < width:
        return None
    mask = response_mask.to(device=routed_experts.device, dtype=torch.bool)
    positions = torch.arange(width, device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=-1, keepdim=True)  # [B, 1]; -1 for an empty row
    selected = (
        routed_experts[:, -width:][mask & (positions != last)].detach().long().cpu()
    )  # [N, layers, top_k]
    if selected.numel() == 0:
        return None
    if selected.min() < 0 or selected.max() >= num_experts:
        logger.warning("rollout MoE metrics: expert ids outside [0, %s); skipped", num_experts)
        return None
    return torch.stack(
        [torch.bincount(layer.flatten(), minlength=num_experts) for layer in selected.unbind(1)]
    )


def load_balance_metrics(load_counts: torch.Tensor | None, prefix: str = "rollout/moe") -> dict[str, Any]:
    """Per layer i ``<prefix>/{max,min,avg}_vio/layer_i`` of the violation share*E - 1 (avg:
    of its absolute value), then each statistic's max and mean over layers."""
    if load_counts is None or load_counts.numel() == 0:
        return {}
    counts = load_counts.float()
    violation = counts / counts.sum(dim=1, keepdim=True).clamp_min(1.0) * counts.shape[1] - 1.0
    stats = {
        "max_vio": violation.amax(dim=1),
        "min_vio": violation.amin(dim=1),
        "avg_vio": violation.abs().mean(dim=1),
    }
    metrics: dict[str, Any] = {}
    for layer in range(counts.shape[0]):
        metrics.update(
            {f"{prefix}/{name}/layer_{layer}": value[layer].item() for name, value in stats.items()}
        )
    for name, value in stats.items():
        metrics[f"{prefix}/{name}/max"] = value.max().item()
        metrics[f"{prefix}/{name}/avg"] = value.mean().item()
    return metrics
