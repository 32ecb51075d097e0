"""The math of supervised fine-tuning and on-policy distillation: pure functions of tensors.

- :func:`sft_loss`: the negative log-likelihood of the trained (assistant) tokens, aggregated
  like the RL losses (``agg_loss``'s modes and global counts, so any dp / micro-batch split
  gives the same gradient).
- :func:`reverse_kl_advantages`: on-policy distillation's per-token advantage at the sampled
  tokens, ``-(log p_student - log p_teacher)`` (a one-sample estimate of the negative reverse KL
  ``KL(student || teacher)``; the teacher-favoured tokens get a positive advantage), optionally
  plus ``coef`` times a rule reward's advantages.

GKD's generalized Jensen-Shannon divergence over the whole vocabulary is in ``algos/gkd.py``.
"""

from __future__ import annotations

import torch

from verl_megatron.algos.aggregation import agg_loss
from verl_megatron.utils.torch_functional import masked_whiten

__all__ = ["reverse_kl_advantages", "reverse_kl_metrics", "sft_loss"]


def sft_loss(
    log_probs: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, **global_batch_info
) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens.

    Args:
        log_probs: [B, T] log p(token_t | tokens_<t) of the target tokens.
        loss_mask: [B, T] 1 where the token is trained on (assistant tokens), 0 elsewhere.
        loss_agg_mode: an ``agg_loss`` mode (``token-mean`` is the usual SFT loss).
        global_batch_info: ``agg_loss``'s dp_size, batch_num_tokens, global_batch_size,
            loss_scale_factor and robust.

    Returns:
        The scalar loss.
    """
    return agg_loss(-log_probs, loss_mask, loss_agg_mode, **global_batch_info)


def reverse_kl_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    rule_advantages: torch.Tensor | None = None,
    coef: float = 0.0,
    whiten: bool = False,
) -> torch.Tensor:
    """Per-token advantages [B, T] of on-policy distillation, 0 on masked cells.

    ``A_t = -(log p_student(y_t) - log p_teacher(y_t)) + coef * rule_advantages_t``: each sampled
    token is rewarded by how much more the teacher likes it than the student does. No discount
    and no baseline: the expectation of A over the student's own samples is ``-KL(student ||
    teacher)`` per position. ``rule_advantages`` (e.g. GRPO's, from a rule reward) are mixed in
    with weight ``coef``; ``coef=0`` is pure distillation.

    ``whiten``: the reverse-KL term minus its mean over the batch's response tokens, divided by
    their standard deviation, before the rule term is added. Subtracting a constant keeps the
    policy gradient's expectation (the expected score of a sampled token is 0) and lowers its
    variance where a confident teacher gives every wrong token a large negative value; dividing
    rescales it.
    """
    if student_log_probs.shape != teacher_log_probs.shape or student_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"reverse_kl_advantages: student {tuple(student_log_probs.shape)}, teacher "
            f"{tuple(teacher_log_probs.shape)} and mask {tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.bool()
    advantages = torch.where(mask, teacher_log_probs.float() - student_log_probs.float(), 0.0)
    if whiten and int(mask.sum()) > 1:
        advantages = masked_whiten(advantages, mask.float())
    if rule_advantages is not None and coef != 0.0:
        advantages = advantages + coef * rule_advantages.float()
    # where, not a product: a non-finite value in the padding must not leak as NaN.
    return torch.where(mask, advantages, torch.zeros_like(advantages))


def reverse_kl_metrics(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """``distill/reverse_kl``: the token mean of ``log p_student - log p_teacher`` at the sampled
    tokens (a one-sample estimate of KL(student || teacher)); ``distill/teacher_log_prob``: the
    teacher's mean log-prob of the student's tokens."""
    mask = response_mask.bool()
    count = max(int(mask.sum()), 1)
    diff = torch.where(mask, student_log_probs.double() - teacher_log_probs.double(), 0.0)
    teacher = torch.where(mask, teacher_log_probs.double(), 0.0)
    return {
        "distill/reverse_kl": float(diff.sum()) / count,
        "distill/teacher_log_prob": float(teacher.sum()) / count,
    }
