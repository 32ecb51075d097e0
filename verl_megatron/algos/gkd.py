"""GKD's generalized Jensen-Shannon divergence over the whole vocabulary, in token chunks.

For student and teacher distributions S and T over the vocabulary at one position and
``beta`` in [0, 1], with the mixture ``M = beta * T + (1 - beta) * S``::

    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)
    beta = 0:  KL(T || S)   (forward KL)        beta = 1:  KL(S || T)   (reverse KL)

(Agarwal et al., "On-Policy Distillation of Language Models", Eq. 1; the numbers of TRL's
``GKDTrainer.generalized_jsd_loss``.) Logits are [B, T, V] in any dtype: each chunk of
``chunk_tokens`` positions is upcast to float32, reduced over V, and (when a gradient is needed)
recomputed in the backward pass, so the float32 [B, T, V] tensors never exist at once.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["generalized_jsd_loss", "generalized_jsd_per_token"]

REDUCTIONS = ("batchmean", "sum", "mean", "none")


def _jsd_rows(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """[n] generalized JSD of n positions' logits [n, V], computed in float32."""
    s = torch.log_softmax(student.float() / temperature, dim=-1)
    t = torch.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    mixture = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    kl_teacher = (t.exp() * (t - mixture)).sum(-1)
    kl_student = (s.exp() * (s - mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def generalized_jsd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Per-position generalized JSD, float32, of logits [..., V] (same shape): shape [...]."""
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
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    needs_grad = torch.is_grad_enabled() and (student.requires_grad or teacher.requires_grad)
    parts = []
    for start in range(0, student.shape[0], chunk_tokens):
        s, t = student[start : start + chunk_tokens], teacher[start : start + chunk_tokens]
        if needs_grad:  # keep only the chunk's inputs; recompute its float32 work in the backward
            parts.append(checkpoint(_jsd_rows, s, t, beta, temperature, use_reentrant=False))
        else:
            parts.append(_jsd_rows(s, t, beta, temperature))
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
