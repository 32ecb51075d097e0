"""Log-probabilities and entropy of sampled tokens from vocabulary-parallel logits.

With tensor parallelism each rank holds a slice of the vocabulary columns of the
logits. Gathering the whole [N, V] tensor on every rank would cost V/tp times
more memory than the slice, so, like megatron's vocab-parallel cross-entropy,
only per-token scalars cross the tensor-parallel group: the row maximum
(all-reduce MAX), the softmax normaliser and the target logit (all-reduce SUM),
and for the entropy the expectation of the logits (all-reduce SUM). The backward
pass needs no communication: the gradient with respect to a rank's own columns
only depends on those columns and the reduced per-token scalars.

Columns past the real vocabulary (megatron pads the vocabulary to a multiple of
tp) are excluded: they never receive probability and get a zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_log_probs"]


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _column_valid(num_columns: int, vocab_start: int, vocab_size: int | None, device) -> torch.Tensor | None:
    """[Vl] bool: which local columns are real vocabulary entries (None when all are)."""
    if vocab_size is None or vocab_start + num_columns <= vocab_size:
        return None
    return torch.arange(vocab_start, vocab_start + num_columns, device=device) < vocab_size


def _shifted_logits(
    logits: torch.Tensor, temperature: float, valid: torch.Tensor | None, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """(z - max_z) in float32 with padded columns at -inf, and the global row max [N]."""
    z = logits.float() / temperature
    if valid is not None:
        z = z.masked_fill(~valid, float("-inf"))
    row_max = z.max(dim=-1).values
    _all_reduce(row_max, dist.ReduceOp.MAX, group)
    return z - row_max.unsqueeze(-1), row_max


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(label) and optionally the entropy H of softmax(logits / temperature), per row."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_start, vocab_size, group, with_entropy):
        valid = _column_valid(logits.shape[-1], vocab_start, vocab_size, logits.device)
        z, row_max = _shifted_logits(logits, temperature, valid, group)
        exp_z = z.exp()
        sum_exp = _all_reduce(exp_z.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_sum_exp = sum_exp.log()

        local = labels - vocab_start
        owned = (local >= 0) & (local < logits.shape[-1])
        picked = z.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), dist.ReduceOp.SUM, group)
        log_probs = target - log_sum_exp

        entropy = None
        if with_entropy:
            probs = exp_z / sum_exp.unsqueeze(-1)
            # Padded columns hold z = -inf and p = 0; where() keeps 0 * -inf out of the sum.
            expected_z = torch.where(probs > 0, probs * z, torch.zeros_like(z)).sum(dim=-1)
            entropy = log_sum_exp - _all_reduce(expected_z, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(logits, row_max, log_sum_exp, local, owned, entropy)
        # An output the loss does not use (the entropy, reported as a metric with
        # entropy_coeff=0) then arrives as None in backward, and its [N, V] pass is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.vocab_start, ctx.vocab_size = vocab_start, vocab_size
        ctx.with_entropy = with_entropy
        if entropy is None:
            entropy = log_probs.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, row_max, log_sum_exp, local, owned, entropy = ctx.saved_tensors
        valid = _column_valid(logits.shape[-1], ctx.vocab_start, ctx.vocab_size, logits.device)
        # Recomputed from the saved input rather than kept from forward: one [N, Vl]
        # float32 tensor less held between forward and backward.
        log_p = logits.float() / ctx.temperature - (row_max + log_sum_exp).unsqueeze(-1)
        if valid is not None:
            log_p = log_p.masked_fill(~valid, float("-inf"))
        probs = log_p.exp()

        if grad_log_probs is not None:
            # d log p_y / d z_j = 1[j = y] - p_j
            grad_z = -probs * grad_log_probs.unsqueeze(-1)
            rows = torch.nonzero(owned, as_tuple=True)
            if rows[0].numel():
                index = (*rows, local[owned])
                grad_z[index] += grad_log_probs[owned]
        else:  # only the entropy reached the loss
            grad_z = torch.zeros_like(probs)
        if ctx.with_entropy and grad_entropy is not None and grad_entropy.numel():
            # dH / d z_j = -p_j (log p_j + H)
            log_p_safe = torch.where(probs > 0, log_p, torch.zeros_like(log_p))
            grad_z -= probs * (log_p_safe + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        grad_logits = (grad_z / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    calculate_entropy: bool = False,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` and entropies under softmax(logits / temperature), vocabulary-parallel.

    Args:
        logits: [..., Vl] this rank's vocabulary slice (columns
            [vocab_start, vocab_start + Vl) of the padded vocabulary).
        labels: [...] global token ids.
        temperature: logits are divided by it first (the sampling temperature).
        vocab_size: the real vocabulary size; columns at or past it are padding and
            get no probability. None: every column is real.
        tp_group: the tensor-parallel group holding the other slices (None: no split).
        vocab_start: first global column of this slice; default rank * Vl in tp_group.
        calculate_entropy: also return the entropy of each row's distribution.
        entropy_requires_grad: False when the entropy is only reported (no entropy bonus in
            the loss): it is then computed without building an autograd graph.

    Returns:
        (log_probs [...], entropy [...] or None), float32, differentiable w.r.t. logits.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_log_probs: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [Vl]"
        )
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_log_probs: temperature must be > 0, got {temperature}")
    if vocab_start is None:
        rank = dist.get_rank(tp_group) if _group_size(tp_group) > 1 else 0
        vocab_start = rank * logits.shape[-1]
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_parallel_log_probs: vocab_size must be positive, got {vocab_size}")
    shape = labels.shape
    if _group_size(tp_group) == 1:
        return _single_slice_log_probs(
            logits, labels, temperature, vocab_size, calculate_entropy, entropy_requires_grad
        )
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1).long(),
        float(temperature),
        int(vocab_start),
        vocab_size,
        tp_group,
        calculate_entropy,
    )
    return log_probs.view(shape), (entropy.view(shape) if calculate_entropy else None)


def _single_slice_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    vocab_size: int | None,
    calculate_entropy: bool,
    entropy_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole vocabulary on one rank: PyTorch's fused log_softmax instead of the
    vocabulary-parallel reductions (several times faster on CPU, same numbers)."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]  # padded columns get no probability
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    log_probs = log_p.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if calculate_entropy:
        with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
            entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy
