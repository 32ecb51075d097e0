"""Config of on-policy distillation (``algorithm.distill``): the frozen teacher and the mix."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.errors import ConfigError
from verl_megatron.models.config import ModelConfig

__all__ = ["DISTILL_LOSSES", "DistillConfig", "TeacherConfig", "TeacherConfigError"]

DISTILL_LOSSES = ("reverse_kl", "gkd_jsd")


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
    """On-policy distillation: the student (the actor) samples and a frozen teacher scores the
    samples. ``loss: reverse_kl``: the per-token advantage is ``-(log p_student - log p_teacher)``
    at the sampled tokens (``algos/distill.reverse_kl_advantages``); ``loss: gkd_jsd``: the actor's
    loss adds GKD's generalized JSD between the two next-token distributions over the whole
    vocabulary at every response position (``algos/gkd.py``, the teacher's logits). Either way
    ``coef`` times the configured estimator's advantages from the rule reward are mixed in.
    Teacher and student must share a tokenizer (cross-tokenizer distillation is future work)."""

    enable: bool = False
    """Replace the advantages with the distillation advantages."""
    loss: str = "reverse_kl"
    """The per-token signal: ``reverse_kl`` (an advantage at the sampled tokens) or ``gkd_jsd`` (a
    loss over the whole vocabulary; the teacher's logits [B, Tr, V] are held on every rank)."""
    coef: float = 0.0
    """Weight of the rule reward's advantages (``algorithm.adv_estimator``) mixed in; 0: pure distillation."""
    whiten: bool = True
    """Subtract the batch mean of the reverse-KL advantages and divide by their std: subtracting
    (a constant baseline) keeps the expected gradient and lowers its variance; dividing rescales
    the gradient by 1/std (``algos/distill.reverse_kl_advantages``)."""
    jsd_beta: float = 0.5
    """``gkd_jsd``: the mixture weight beta in [0, 1] (0: forward KL(teacher || student), 1: reverse KL)."""
    jsd_temperature: float = 1.0
    """``gkd_jsd``: both logits are divided by it before the softmax (> 0)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher model and how it runs."""

    def __post_init__(self) -> None:
        if self.loss not in DISTILL_LOSSES:
            raise TeacherConfigError(
                f"algorithm.distill.loss={self.loss!r}; expected one of {DISTILL_LOSSES}"
            )
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise TeacherConfigError(f"algorithm.distill.jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if not self.jsd_temperature > 0:
            raise TeacherConfigError(
                f"algorithm.distill.jsd_temperature must be > 0, got {self.jsd_temperature}"
            )
