"""Tensor helpers under verl's names (``verl.utils.torch_functional``) and with its numbers.

Masked reductions over [B, T] tensors are NaN-free on an empty mask: a masked mean over no
element is 0 and a variance over fewer than two elements is 0 (verl raises there), so a
degenerate batch degrades to zero advantages instead of poisoning the optimizer with NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_megatron.errors import VerlCompatError

__all__ = [
    "calculate_sum_pi_squared_from_logits",
    "clip_by_value",
    "distributed_masked_mean",
    "distributed_mean_max_min_std",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "expand_as_nested",
    "gather_from_labels",
    "get_response_mask",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
]

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


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """``entropy_from_logits`` of [N, V] logits, ``chunk_size`` rows at a time in float32: [N]."""
    entropy = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    for start in range(0, logits.shape[0], chunk_size):
        entropy[start : start + chunk_size] = entropy_from_logits(logits[start : start + chunk_size].float())
    return entropy


def gather_from_labels(data: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """``data[..., label]`` for each position: [..., V] and [...] -> [...]."""
    return torch.gather(data, -1, label.unsqueeze(-1)).squeeze(-1)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """log softmax(logits)[label]: [..., V] and [...] -> [...].

    Computed as ``logit[label] - logsumexp(logits)`` in float32/float64, one leading row at a time
    to bound the peak memory; bf16/fp16 go through ``log_softmax`` because logsumexp loses too much
    precision there. ``inplace_backward`` is accepted for verl's signature (its fused CUDA kernel).
    """
    del inplace_backward
    if logits.dtype in (torch.float32, torch.float64):
        picked = gather_from_labels(logits, labels)
        normaliser = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - normaliser
    rows = [
        gather_from_labels(F.log_softmax(row, dim=-1), lab) for row, lab in zip(logits, labels, strict=True)
    ]
    return torch.stack(rows)


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to [tensor_min, tensor_max], bounds broadcast element-wise."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def get_response_mask(
    response_id: torch.Tensor, eos_token: int | list[int] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """1 up to and including the first EOS token of each row, 0 after it: [B, T] -> [B, T]."""
    is_eos = torch.isin(response_id, torch.tensor(eos_token, device=response_id.device)).int()
    return (is_eos.cumsum(dim=1) - is_eos).eq(0).to(dtype)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: int, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dimension of [B, T] to ``max_seq_len`` with ``pad_token_id`` (unchanged if longer)."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), value=pad_token_id)


def pad_2d_list_to_length(
    response: list[list[int]], pad_token_id: int, max_length: int | None = None
) -> torch.Tensor:
    """Ragged token lists as one [B, max(len, max_length)] tensor, right-padded."""
    width = max((len(row) for row in response), default=0)
    if max_length is not None:
        width = max(width, max_length)
    return torch.tensor([list(row) + [pad_token_id] * (width - len(row)) for row in response])


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 along the last axis: [..., V] -> [...].

    Uses sum pi^2 = exp(logsumexp(2 z) - 2 logsumexp(z)), which never forms exp(z) and so stays
    finite for logits of any magnitude.
    """
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor,
    compute_max: bool = True,
    compute_min: bool = True,
    compute_std: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(mean, max, min, std) of all elements on every rank of ``group``; a disabled one is None.

    std is the sample standard deviation (divides by N - 1, N the global element count).
    """
    total = local_tensor.sum()
    count = torch.tensor(local_tensor.numel(), device=local_tensor.device, dtype=total.dtype)
    dist.all_reduce(total, group=group)
    dist.all_reduce(count, group=group)
    mean = total / count
    gmax = gmin = std = None
    if compute_max:
        gmax = local_tensor.max()
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    if compute_min:
        gmin = local_tensor.min()
        dist.all_reduce(gmin, op=dist.ReduceOp.MIN, group=group)
    if compute_std:
        squares = (local_tensor - mean).pow(2).sum()
        dist.all_reduce(squares, group=group)
        std = torch.sqrt(squares / (count - 1))
    return mean, gmax, gmin, std


def distributed_masked_mean(
    local_tensor: torch.Tensor, local_mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Mean of the elements selected by ``local_mask`` over every rank of ``group``."""
    total = (local_tensor * local_mask).sum()
    count = local_mask.sum().to(total.dtype)
    dist.all_reduce(total, group=group)
    dist.all_reduce(count, group=group)
    return total / count


def expand_as_nested(tensor: torch.Tensor, nested_tensor: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``tensor`` [B] repeated over the ragged row ``i`` of a jagged [B, *] nested tensor."""
    if not nested_tensor.is_nested:
        raise VerlCompatError("expand_as_nested: nested_tensor must be a nested (jagged) tensor")
    if tensor.dim() != 1:
        raise VerlCompatError(f"expand_as_nested: tensor must be 1-D [B], got shape {tuple(tensor.shape)}")
    if tensor.shape[0] != nested_tensor.size(0):
        raise VerlCompatError(
            f"expand_as_nested: tensor has {tensor.shape[0]} rows but nested_tensor has {nested_tensor.size(0)}"
        )
    if nested_tensor.dim() != 2:
        raise VerlCompatError(
            f"expand_as_nested: nested_tensor must be [B, *], got {nested_tensor.dim()} dims"
        )
    offsets = nested_tensor.offsets()
    values = torch.repeat_interleave(tensor, offsets.diff(), dim=0)
    return torch.nested.nested_tensor_from_jagged(values=values, offsets=offsets)
