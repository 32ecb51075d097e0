"""GKD's generalized Jensen-Shannon divergence over the whole vocabulary, in token chunks.

For student and teacher distributions S and T over the vocabulary at one position and
``beta`` in [0, 1], with the mixture ``M = beta * T + (1 - beta) * S``::

    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)
    beta = 0:  KL(T || S)   (forward KL)        beta = 1:  KL(S || T)   (reverse KL)

(Agarwal et al., "On-Policy Distillation of Language Models", Eq. 1; the numbers of TRL's
``GKDTrainer.generalized_jsd_loss``.) Logits are [B, T, V] in any dtype: each chunk of
``chunk_tokens`` positions is upcast to float32, reduced over V, and (when a gradient is needed)
recomputed in the backward pass, so the float32 [B, T, V] tensors never exist at once.

With tensor parallelism (``tp_group``) each rank holds its own columns of both logits (the
vocabulary split like megatron's LM head): only per-position scalars cross the group (the row
maximum, the softmax normaliser and each KL's partial sum forward; the normaliser's gradient
backward), and each rank's gradient reaches its own columns, as in ``models/logprobs.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

__all__ = ["generalized_jsd_loss", "generalized_jsd_per_token"]

REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _kl_parts(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """[n, k] the KL sums over the columns of log-probs s, t [n, V]: KL(T || S) (beta 0), KL(S || T)
    (beta 1), else KL(T || M) and KL(S || M) with log M = logaddexp(log beta + t, log(1 - beta) + s)."""
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1, keepdim=True)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1, keepdim=True)
    mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return torch.stack([(t.exp() * (t - mixture)).sum(-1), (s.exp() * (s - mixture)).sum(-1)], dim=-1)


def _combine(parts: torch.Tensor, beta: float) -> torch.Tensor:
    """[n] JSD_beta from :func:`_kl_parts`' sums."""
    if parts.shape[-1] == 1:
        return parts[:, 0]
    return beta * parts[:, 0] + (1.0 - beta) * parts[:, 1]


def _jsd_rows(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """[n] generalized JSD of n positions' logits [n, V], computed in float32."""
    s = torch.log_softmax(student.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher.float() / temperature, dim=-1)
    return _combine(_kl_parts(s, t, beta), beta)


# Tensor parallelism: the collectives stay out of the checkpointed (recomputed) pieces, so every
# rank runs them once, in the same order, in the forward and backward passes.
class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the group of each rank's partial sums. Backward: the gradient as it
    is (every rank holds the same replicated result; each rank's partial came from its columns)."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        return grad_total, None


class _SharedOverRanks(torch.autograd.Function):
    """Forward: a per-position value every rank then uses on its own columns, unchanged.
    Backward: the sum over the group of the ranks' gradients (each saw its columns only)."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def _local_exp_sum(logits: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.float() / temperature - row_max.unsqueeze(-1)).exp().sum(-1)


def _local_kl_parts(student, teacher, lse_s, lse_t, beta: float, temperature: float) -> torch.Tensor:
    s = student.float() / temperature - lse_s.unsqueeze(-1)
    t = teacher.float() / temperature - lse_t.unsqueeze(-1)
    return _kl_parts(s, t, beta)


def _maybe_checkpoint(fn, needs_grad: bool, *args):
    """``fn(*args)``; with a gradient, its float32 [n, Vl] work is recomputed in the backward."""
    return checkpoint(fn, *args, use_reentrant=False) if needs_grad else fn(*args)


def _log_normalizer(logits: torch.Tensor, temperature: float, group, needs_grad: bool) -> torch.Tensor:
    """[n] log-sum-exp over the whole vocabulary of logits / temperature given as [n, Vl] columns."""
    with torch.no_grad():  # the shift cancels in the result: no gradient through the maximum
        local = logits.float() / temperature
        row_max = local.amax(-1) if local.shape[-1] else local.new_full(local.shape[:-1], float("-inf"))
        del local
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    partial = _maybe_checkpoint(_local_exp_sum, needs_grad, logits, row_max, temperature)
    return row_max + _SumOverRanks.apply(partial, group).log()


def _jsd_rows_tp(student, teacher, beta: float, temperature: float, group, needs_grad: bool) -> torch.Tensor:
    """[n] generalized JSD of [n, Vl] column slices of a vocabulary split over ``group``."""
    lse_s = _SharedOverRanks.apply(_log_normalizer(student, temperature, group, needs_grad), group)
    with torch.no_grad():
        lse_t = _log_normalizer(teacher, temperature, group, False)
    parts = _maybe_checkpoint(_local_kl_parts, needs_grad, student, teacher, lse_s, lse_t, beta, temperature)
    return _combine(_SumOverRanks.apply(parts, group), beta)


def generalized_jsd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    tp_group=None,
) -> torch.Tensor:
    """Per-position generalized JSD, float32, of logits [..., V] (same shape): shape [...].

    ``tp_group``: the logits are this rank's columns [..., Vl] of a vocabulary split over the
    group (the same columns of both; padded columns already dropped); every rank gets the
    whole per-position values, and the gradient reaches the student only (the teacher is
    detached). None: the logits hold the whole vocabulary.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape (the vocabularies must match)"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"generalized_jsd: temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"generalized_jsd: chunk_tokens must be >= 1, got {chunk_tokens}")
    shape, vocab = student_logits.shape[:-1], student_logits.shape[-1]
    rows = math.prod(shape)  # explicit: a rank may hold no column of the vocabulary (vocab 0)
    student, teacher = student_logits.reshape(rows, vocab), teacher_logits.reshape(rows, vocab)
    needs_grad = torch.is_grad_enabled() and (student.requires_grad or teacher.requires_grad)
    if tp_group is not None and (not dist.is_initialized() or dist.get_world_size(tp_group) == 1):
        tp_group = None
    if tp_group is not None:
        teacher = teacher.detach()
    parts = []
    for start in range(0, student.shape[0], chunk_tokens):
        s, t = student[start : start + chunk_tokens], teacher[start : start + chunk_tokens]
        if tp_group is not None:
            parts.append(_jsd_rows_tp(s, t, beta, temperature, tp_group, needs_grad))
        else:  # with a gradient: keep only the chunk's inputs; recompute its float32 work in the backward
            parts.append(_maybe_checkpoint(_jsd_rows, needs_grad, s, t, beta, temperature))
    if not parts:
        return student.new_zeros(shape, dtype=torch.float32)
    return torch.cat(parts).reshape(shape)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """The generalized JSD of logits [B, T, V], reduced like TRL's ``generalized_jsd_loss``.

    ``labels`` [B, T]: positions labelled -100 are left out. ``reduction``: "batchmean" (sum over
    kept positions / their count, at least 1; without labels / B), "sum", "mean" (over every
    element of [B, T, V], as TRL's ``jsd.mean()``) or "none" (the per-position values of the kept
    positions, [N]; without labels [B, T]).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"generalized_jsd_loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    vocab = student_logits.shape[-1]
    if labels is not None:
        keep = labels != -100
        student_logits, teacher_logits = student_logits[keep], teacher_logits[keep]
    jsd = generalized_jsd_per_token(student_logits, teacher_logits, beta, temperature, chunk_tokens)
    if reduction == "none":
        return jsd
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.sum() / max(jsd.numel() * vocab, 1)
    denominator = int(keep.sum()) if labels is not None else student_logits.shape[0]
    return jsd.sum() / max(denominator, 1)
