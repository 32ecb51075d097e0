"""Value (critic) loss and entropy loss."""

from __future__ import annotations

import torch

from verl_megatron.algos.aggregation import Count, agg_loss
from verl_megatron.utils.torch_functional import entropy_from_logits, masked_mean

__all__ = ["compute_entropy_loss", "compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Count | None = None,
    global_batch_size: Count | None = None,
    loss_scale_factor: Count | None = None,
    *,
    robust: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped PPO value loss; all inputs [B, T].

    v_clip = clamp(vpreds, values - c, values + c);
    vf_loss = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2)) with agg_loss's mode and
    global counts (`robust` as in agg_loss); vf_clipfrac = masked mean of [(v_clip - R)^2 > (vpreds - R)^2].
    """
    for name, tensor in (("returns", returns), ("values", values), ("response_mask", response_mask)):
        if tensor.shape != vpreds.shape:
            raise ValueError(
                f"compute_value_loss: {name} has shape {tuple(tensor.shape)}, vpreds {tuple(vpreds.shape)}"
            )
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
        robust=robust,
    )
    vf_clipfrac = masked_mean(torch.gt(clipped, unclipped).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    robust: bool = False,
) -> torch.Tensor:
    """agg_loss of the per-token entropy of softmax(logits [B, T, V]) under response_mask [B, T]."""
    if logits.shape[:-1] != response_mask.shape:
        raise ValueError(
            f"compute_entropy_loss: logits {tuple(logits.shape)} do not match response_mask "
            f"{tuple(response_mask.shape)} as [B, T, V] vs [B, T]"
        )
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, robust=robust)
