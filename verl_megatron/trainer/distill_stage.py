"""The distillation stage of the PPO step (``algorithm.distill.enable``).

``teacher_log_probs`` puts the frozen teacher's log-probs of the sampled tokens in the batch
(timed as ``timing_s/teacher``); with ``algorithm.distill.loss: gkd_jsd`` also its logits
[B, Tr, V] (``teacher_logits``, the log-probs are read from them). ``distill_advantages`` then
replaces the estimator's advantages: ``reverse_kl`` by the reverse-KL ones
(``algos/distill.reverse_kl_advantages``: ``-(log p_student - log p_teacher)``, plus
``algorithm.distill.coef`` times the rule reward's advantages); ``gkd_jsd`` by ``coef`` times the
rule reward's alone, and asks the actor's update (``meta_info["distill_jsd"]``) to add the
generalized JSD to its loss (``workers/actor.MegatronActor.update_policy``, ``algos/gkd.py``).
The student's log-probs are the recomputed ``old_log_probs`` (or, in bypass mode, the rollout's).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from verl_megatron.algos.distill import reverse_kl_advantages, reverse_kl_metrics
from verl_megatron.models.logprobs import vocab_parallel_log_probs
from verl_megatron.protocol import DataProto
from verl_megatron.trainer import metrics as M
from verl_megatron.trainer.distill_checks import check_teacher_pair
from verl_megatron.workers.teacher_config import DistillConfig

__all__ = [
    "DistillTeacher",
    "build_teacher",
    "distill_advantages",
    "teacher_log_probs",
]


class DistillTeacher(Protocol):
    """What the step needs of the teacher (``workers/teacher.MegatronTeacher``)."""

    param_bytes: int

    def compute_log_prob(self, data: DataProto) -> torch.Tensor: ...

    def compute_logits(self, data: DataProto) -> torch.Tensor: ...

    def close(self) -> None: ...


def build_teacher(config: Any, runtime: Any) -> DistillTeacher | None:
    """The teacher of ``algorithm.distill`` (None when off), after checking it can teach this
    student (``workers/teacher.check_teacher``: a named error, before the teacher is built)."""
    distill = config.algorithm.distill
    if not distill.enable:
        return None
    from verl_megatron.workers.teacher import MegatronTeacher

    check_teacher_pair(config)
    return MegatronTeacher(runtime, distill.teacher)


def teacher_log_probs(
    teacher: DistillTeacher, batch: DataProto, timing: dict[str, float], config: DistillConfig
) -> dict[str, float]:
    """``teacher_log_probs`` [B, Tr] (and for ``gkd_jsd`` ``teacher_logits`` [B, Tr, V]) into the
    batch. Metrics: the teacher's parameter memory on this rank, for ``gkd_jsd`` that of the
    logits, and on a GPU the stage's peak device memory."""
    tensors = batch.batch
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    metrics = {"distill/teacher_param_gb": teacher.param_bytes / 2**30}
    with M.timed("teacher", timing):
        if config.loss == "gkd_jsd":
            logits = tensors["teacher_logits"] = teacher.compute_logits(batch)
            width = tensors["responses"].shape[1]
            valid = tensors["attention_mask"][:, -width:].bool()
            log_probs, _ = vocab_parallel_log_probs(
                logits, tensors["responses"], temperature=float(batch.meta_info["temperature"])
            )
            tensors["teacher_log_probs"] = torch.where(valid, log_probs, torch.zeros_like(log_probs))
            metrics["distill/teacher_logits_gb"] = logits.numel() * logits.element_size() / 2**30
        else:
            tensors["teacher_log_probs"] = teacher.compute_log_prob(batch)
    if cuda:
        metrics["distill/teacher_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return metrics


def distill_advantages(batch: DataProto, config: DistillConfig) -> dict[str, float]:
    """Replace ``advantages`` (and ``returns``) by the distillation advantages; ``distill/*`` metrics."""
    tensors = batch.batch
    student = tensors["old_log_probs"]
    mask = tensors["response_mask"]
    if config.loss == "gkd_jsd":  # the signal is the actor's JSD loss; the advantages are the rule's
        advantages = torch.where(mask.bool(), config.coef * tensors["advantages"].float(), 0.0)
        batch.meta_info["distill_jsd"] = {"beta": config.jsd_beta, "temperature": config.jsd_temperature}
    else:
        advantages = reverse_kl_advantages(
            student,
            tensors["teacher_log_probs"],
            mask,
            tensors["advantages"],
            config.coef,
            whiten=config.whiten,
        )
    tensors["advantages"], tensors["returns"] = advantages, advantages
    return reverse_kl_metrics(student, tensors["teacher_log_probs"], mask)
