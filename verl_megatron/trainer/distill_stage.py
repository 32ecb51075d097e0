"""The distillation stage of the PPO step (``algorithm.distill.enable``).

``teacher_log_probs`` puts the frozen teacher's log-probs of the sampled tokens in the batch
(timed as ``timing_s/teacher``); ``distill_advantages`` then replaces the estimator's advantages
by the reverse-KL ones (``algos/distill.reverse_kl_advantages``: ``-(log p_student - log
p_teacher)``, plus ``algorithm.distill.coef`` times the rule reward's advantages). The student's
log-probs are the recomputed ``old_log_probs`` (or, in bypass mode, the rollout's).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from verl_megatron.algos.distill import reverse_kl_advantages, reverse_kl_metrics
from verl_megatron.errors import ConfigError
from verl_megatron.protocol import DataProto
from verl_megatron.trainer import metrics as M
from verl_megatron.workers.teacher_config import DistillConfig

__all__ = ["DistillTeacher", "build_teacher", "check_distill", "distill_advantages", "teacher_log_probs"]


class DistillTeacher(Protocol):
    """What the step needs of the teacher (``workers/teacher.MegatronTeacher``)."""

    param_bytes: int

    def compute_log_prob(self, data: DataProto) -> torch.Tensor: ...

    def close(self) -> None: ...


def check_distill(config: Any) -> None:
    """Start-up checks of ``algorithm.distill`` that span sections (before any model is built)."""
    if not config.algorithm.distill.enable:
        return
    if not (config.actor.recompute_old_log_prob or config.algorithm.rollout_correction.bypass_mode):
        raise ConfigError(
            "algorithm.distill.enable=true compares the student's log-probs of its samples with the "
            "teacher's: set actor.recompute_old_log_prob=true (or bypass mode)"
        )
    if config.rollout.placement == "separate":
        raise ConfigError(
            "algorithm.distill.enable=true runs with rollout.placement=colocated only (for now)"
        )
    if config.model.path:  # else the quickstart builds the student: checked once it exists (build_teacher)
        from verl_megatron.workers.teacher import check_teacher

        check_teacher(config.algorithm.distill.teacher, config.model.tokenizer_path or config.model.path)


def build_teacher(config: Any, runtime: Any) -> DistillTeacher | None:
    """The teacher of ``algorithm.distill`` (None when off), after checking it can teach this
    student (``workers/teacher.check_teacher``: a named error, before the teacher is built)."""
    distill = config.algorithm.distill
    if not distill.enable:
        return None
    from verl_megatron.workers.teacher import MegatronTeacher, check_teacher

    check_teacher(distill.teacher, config.model.tokenizer_path or config.model.path)
    return MegatronTeacher(runtime, distill.teacher)


def teacher_log_probs(
    teacher: DistillTeacher, batch: DataProto, timing: dict[str, float]
) -> dict[str, float]:
    """``teacher_log_probs`` [B, Tr] into the batch; the teacher's parameter memory on this rank."""
    with M.timed("teacher", timing):
        batch.batch["teacher_log_probs"] = teacher.compute_log_prob(batch)
    return {"distill/teacher_param_gb": teacher.param_bytes / 2**30}


def distill_advantages(batch: DataProto, config: DistillConfig) -> dict[str, float]:
    """Replace ``advantages`` (and ``returns``) by the distillation advantages; ``distill/*`` metrics."""
    tensors = batch.batch
    student = tensors["old_log_probs"]
    mask = tensors["response_mask"]
    advantages = reverse_kl_advantages(
        student, tensors["teacher_log_probs"], mask, tensors["advantages"], config.coef, whiten=config.whiten
    )
    tensors["advantages"], tensors["returns"] = advantages, advantages
    return reverse_kl_metrics(student, tensors["teacher_log_probs"], mask)
