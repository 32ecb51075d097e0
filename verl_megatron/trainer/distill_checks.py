"""The start-up checks of ``algorithm.distill`` (before any model is built).

Apart from the stage because every front-end process validates the config before torchrun starts
the ranks: these checks must not import the stage's protocol and metrics (tensordict, torch._dynamo).
"""

from __future__ import annotations

from typing import Any

from verl_megatron.errors import ConfigError

__all__ = ["check_distill", "check_teacher_layout", "check_teacher_pair"]


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
        check_teacher_pair(config)


def check_teacher_layout(config: Any, world_size: int, this_machine: bool = True) -> None:
    """The teacher's own tp/pp over the run's ``world_size`` ranks and its model settings, as
    ``MegatronTeacher`` builds it (``workers/teacher.teacher_layout``): part of the config check,
    so a bad teacher layout stops before the student, the rollout or the teacher is built
    (``this_machine``: see ``validate_config``)."""
    if config.algorithm.distill.enable:
        from verl_megatron.workers.teacher import teacher_layout

        teacher_layout(config.algorithm.distill.teacher, world_size, this_machine)


def check_teacher_pair(config: Any) -> None:
    """The teacher can teach this student: one vocabulary (and, for gkd_jsd, one logit width)."""
    from verl_megatron.workers.teacher import check_teacher, check_teacher_logits

    distill = config.algorithm.distill
    check_teacher(distill.teacher, config.model.tokenizer_path or config.model.path)
    if distill.loss == "gkd_jsd":
        check_teacher_logits(distill.teacher, config.model.path)
