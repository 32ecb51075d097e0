"""Reduce a [B, T] per-token loss to a scalar, with global counts for data parallelism.

Each rank (and each micro-batch) sees a shard of the global mini-batch. When the
shard's loss is normalised by counts of the WHOLE global mini-batch and multiplied
by `dp_size`, the dp-averaged sum of shard gradients is exactly the gradient of the
loss computed on the global mini-batch at once, whatever the split.
"""

from __future__ import annotations

import torch

from verl_megatron.utils.torch_functional import masked_sum

__all__ = ["LOSS_AGG_MODES", "agg_loss", "megatron_microbatch_loss"]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# verl's per-sequence token-mean denominator offset; a fully masked row gives 0 / 1e-8 = 0.
_SEQ_TOKEN_MEAN_EPS = 1e-8

Count = int | float | torch.Tensor


def _denominator(
    given: Count | None, local: torch.Tensor, dp_size: int, name: str, mode: str, robust: bool
) -> Count:
    """The normaliser: the global count if given, else the local one (only valid without dp).

    `robust`: the count as a tensor of the reduction dtype, with 0 replaced by 1. The
    numerator is 0 whenever the count is 0 (every element masked), so the loss is then a
    finite 0 with a zero gradient instead of verl's 0/0 = NaN; any other count, fractional
    ones included, is used as is.
    """
    if given is None:
        if dp_size > 1:
            raise ValueError(
                f"agg_loss(loss_agg_mode={mode!r}, dp_size={dp_size}): {name} (the count over the global "
                "mini-batch) is required when dp_size > 1, otherwise each rank normalises by its own shard"
            )
        given = local
    if not robust:
        return given
    count = torch.as_tensor(given, device=local.device).to(local.dtype)
    return torch.where(count == 0, torch.ones_like(count), count)


def _check(loss_mat: torch.Tensor, loss_mask: torch.Tensor, mode: str, dp_size: int, scale: Count) -> None:
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(
            f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape"
        )
    if dp_size < 1:
        raise ValueError(f"agg_loss: dp_size must be >= 1, got {dp_size}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"agg_loss: invalid loss_agg_mode {mode!r}; valid modes are {LOSS_AGG_MODES}")
    if mode == "seq-mean-token-sum-norm" and float(scale) <= 0:
        raise ValueError(f"agg_loss: loss_scale_factor must be > 0, got {scale}")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count | None = None,
    global_batch_size: Count | None = None,
    loss_scale_factor: Count | None = None,
    *,
    robust: bool = False,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] under `loss_mask` [B, T] into a scalar.

    Modes (m = mask, N = batch_num_tokens or sum(m), G = global_batch_size or the
    number of rows with at least one unmasked token):
      - token-mean:              sum(L*m) / N * dp_size
      - token-sum:               sum(L*m) * dp_size
      - seq-mean-token-sum:      sum_i s_i / G * dp_size,  s_i = sum_t L*m over valid rows
      - seq-mean-token-mean:     same with s_i = sum_t L*m / (sum_t m + 1e-8)
      - seq-mean-token-sum-norm: the seq-mean-token-sum value / loss_scale_factor
                                 (default T = loss_mask.shape[-1]; pass a constant when T
                                 varies between micro-batches, or the scale changes with padding)

    With dp_size > 1 the global counts (N for token-mean, G for the seq modes) are required.
    The default gives verl 0.9.1's numbers, edge cases included: a count of 0 (an all-masked
    batch, or global counts of 0) is 0/0 = NaN except in token-sum; inf/NaN in the padding
    of a row that has tokens reaches the seq modes' result; the reduction runs in the
    inputs' dtype. `robust=True` (what the project's actor and critic pass) makes a count
    of 0 give a finite 0 with a zero gradient, keeps every masked value out of every mode,
    and reduces (and returns) low-precision inputs in float32, so bf16 counts stay exact.
    """
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    _check(loss_mat, loss_mask, loss_agg_mode, dp_size, scale)
    mask = loss_mask
    if robust:
        # Reduce in at least float32: a bf16 sum of a mask is not an exact token count past 256.
        acc_dtype = torch.promote_types(loss_mat.dtype, torch.float32)
        loss_mat, mask = loss_mat.to(acc_dtype), loss_mask.to(acc_dtype)

    if loss_agg_mode == "token-mean":
        n = _denominator(batch_num_tokens, mask.sum(), dp_size, "batch_num_tokens", loss_agg_mode, robust)
        return masked_sum(loss_mat, mask) / n * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size

    tokens_per_seq = mask.sum(dim=-1)
    # verl sums a plain product here, so a NaN in the padding of a row with tokens survives.
    seq_losses = masked_sum(loss_mat, mask, axis=-1) if robust else (loss_mat * mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (tokens_per_seq + _SEQ_TOKEN_MEAN_EPS)
    valid_seqs = (tokens_per_seq > 0).to(torch.promote_types(loss_mat.dtype, torch.float32))
    g = _denominator(global_batch_size, valid_seqs.sum(), dp_size, "global_batch_size", loss_agg_mode, robust)
    loss = masked_sum(seq_losses, valid_seqs) / g * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / scale
    return loss


def megatron_microbatch_loss(loss: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """Scale a micro-batch loss for megatron-core's `forward_backward_func` (2-tuple path).

    Contract (megatron-core 0.16, `calculate_per_token_loss=False`):
      1. Compute `loss` for ONE micro-batch with `agg_loss` (or a registered policy loss)
         using the counts of the WHOLE global mini-batch on all dp ranks:
         `dp_size` = data-parallel size (without cp), `batch_num_tokens` = unmasked
         response tokens of the global mini-batch, `global_batch_size` = its number of
         sequences with at least one unmasked token, a constant `loss_scale_factor`.
      2. Return `megatron_microbatch_loss(loss, num_microbatches)` as the first element of
         the loss function's `(loss, metrics)` tuple.
    What megatron then does: the schedule multiplies the returned value by the
    context-parallel size and divides it by `num_microbatches`; backward runs on that;
    DDP sums gradients over the dp x cp group and divides by dp * cp. The
    num_microbatches factor cancels here; the cp factor cancels DDP's 1/cp, provided
    the cp ranks' gradients of a micro-batch add up to the micro-batch gradient (each
    cp rank backpropagates only through its own token slice, e.g. log-probs all-gathered
    across cp with the gradient kept for the local slice). The net gradient is then the
    gradient of `agg_loss` over the global mini-batch in one shot, for every mode and any
    dp x cp x micro-batch layout. There is deliberately no cp_size argument: dividing by
    cp here would make the gradient cp times too small. Report `loss` (not the returned
    value) in the metrics: with global counts, summing `loss` over micro-batches and dp
    ranks and dividing by dp_size gives the global mini-batch loss.

    Args:
        loss: scalar loss of the micro-batch (global counts, see above).
        num_microbatches: micro-batches this rank runs in the same `forward_backward_func` call.
    """
    if num_microbatches < 1:
        raise ValueError(f"megatron_microbatch_loss: num_microbatches must be >= 1, got {num_microbatches}")
    return loss * num_microbatches
