"""Masked reductions over [B, T] tensors, with verl's names and numbers.

Every helper here is NaN-free on an empty mask: a masked mean over no element is 0
and a variance over fewer than two elements is 0, so a degenerate batch degrades to
zero advantages instead of poisoning the optimizer with NaN.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "masked_mean", "masked_sum", "masked_var", "masked_whiten"]

# verl adds this to the element count of a masked mean; kept so numbers match verl's.
_MEAN_EPS = 1e-8
# verl adds this to the variance before the rsqrt of a whitening.
_WHITEN_EPS = 1e-8


def _check_same_shape(values: torch.Tensor, mask: torch.Tensor, where: str) -> None:
    if values.shape != mask.shape:
        raise ValueError(
            f"{where}: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape"
        )


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero; values under the mask may be inf/NaN.

    `torch.where` (not a product) keeps a NaN in a padded slot out of the sum and
    gives it a zero gradient.
    """
    _check_same_shape(values, mask, "masked_sum")
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (kept * mask).sum(dim=axis)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of `values` over the elements selected by `mask` (0 when none is selected)."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + _MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of `values` (a scalar).

    With `unbiased`, Bessel's correction n / (n - 1) is applied. verl raises for
    n <= 1; here the variance of fewer than two samples is 0, which makes
    `masked_whiten` return centred values (exactly 0 for a single sample).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.sum()
    bessel = count / (count - 1).clamp(min=1)
    return torch.where(count > 1, variance * bessel, torch.zeros_like(variance))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked elements.

    With `shift_mean=False` the mean is added back after scaling. Every element
    (masked or not) is transformed; callers multiply by the mask when they need zeros.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last axis: [..., V] -> [...].

    Uses H = logsumexp(z) - sum(softmax(z) * z), which never takes a log of 0.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
