"""Config of on-policy distillation (``algorithm.distill``): the frozen teacher and the mix."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ConfigError
from verl_megatron.models.config import ModelConfig

__all__ = ["DISTILL_LOSSES", "DistillConfig", "TeacherConfig", "TeacherConfigError"]

DISTILL_LOSSES = ("reverse_kl",)


class TeacherConfigError(ConfigError):
    """``algorithm.distill``: a teacher that cannot teach this student (path, vocabulary, settings)."""


@dataclass
class TeacherConfig:
    """The teacher: any Hugging Face causal LM with the student's tokenizer, kept frozen."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(dtype="float32"))
    """Its checkpoint (``model.path``) and build settings (dtype, use_te, ...), like ``model``."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """Its own tp/pp (dp is what the world size leaves); independent of the student's ``parallel``."""
    micro_batch_size_per_gpu: int = 8
    """Sequences per forward micro-batch on one dp rank (when ``use_dynamic_bsz`` is false)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget (``max_token_len_per_gpu``) instead."""
    max_token_len_per_gpu: int = 16384
    """Token budget of one dynamic micro-batch."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences into one row."""
    offload: bool = False
    """Keep the teacher's weights in host memory between its forward passes (GPU only; a no-op on CPU)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size_per_gpu < 1:
            raise TeacherConfigError(
                f"algorithm.distill.teacher.micro_batch_size_per_gpu must be >= 1, got {self.micro_batch_size_per_gpu}"
            )


@dataclass
class DistillConfig:
    """On-policy distillation: the student (the actor) samples, a frozen teacher scores each
    sampled token, and the per-token advantage is ``-(log p_student - log p_teacher)``
    (reverse KL, ``algos/distill.reverse_kl_advantages``), plus ``coef`` times the configured
    estimator's advantages from the rule reward. Teacher and student must share a tokenizer
    (cross-tokenizer distillation is future work)."""

    enable: bool = False
    """Replace the advantages with the distillation advantages."""
    loss: str = "reverse_kl"
    """The per-token signal: ``reverse_kl`` (on the sampled tokens)."""
    coef: float = 0.0
    """Weight of the rule reward's advantages (``algorithm.adv_estimator``) mixed in; 0: pure distillation."""
    whiten: bool = True
    """Subtract the batch mean of the reverse-KL advantages and divide by their std (a constant
    baseline: the same expected gradient, less variance; ``algos/distill.reverse_kl_advantages``)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher model and how it runs."""

    def __post_init__(self) -> None:
        if self.loss not in DISTILL_LOSSES:
            raise TeacherConfigError(
                f"algorithm.distill.loss={self.loss!r}; expected one of {DISTILL_LOSSES}"
            )
