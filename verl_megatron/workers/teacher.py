"""The frozen teacher of on-policy distillation: log-probs of the student's sampled tokens.

Any Hugging Face causal LM with the student's tokenizer (``algorithm.distill.teacher.model.path``),
built on megatron with its own tp/pp (``algorithm.distill.teacher.parallel``) through a
:class:`~verl_megatron.distributed.parallel_state_slot.ParallelStateSlot` when that layout differs
from the student's (as the reward model does), kept frozen, and with ``offload`` parked in host
memory between its forward passes. Its log-probs come from the reference policy's forward
(``MegatronRef``): the same packing, micro-batching and temperature as the student's.

``check_teacher`` runs at start-up, before any model is built: the checkpoint exists and its
tokenizer is the student's (the same token for every id); so does ``teacher_layout`` (its own
tp/pp over the run's ranks and its model settings, the layout the teacher is then built on). Distillation across tokenizers needs
the two sequences aligned token by token, which is future work.
"""

from __future__ import annotations

import contextlib
import os

import torch

from verl_megatron.distributed.parallel import ParallelLayout, Runtime
from verl_megatron.errors import ModelConfigError, ParallelConfigError
from verl_megatron.models.offload import Offloader
from verl_megatron.protocol import DataProto
from verl_megatron.workers.actor import MegatronRef
from verl_megatron.workers.config import RefConfig
from verl_megatron.workers.teacher_config import TeacherConfig, TeacherConfigError

__all__ = ["MegatronTeacher", "check_teacher", "check_teacher_logits", "teacher_layout"]


def check_teacher(config: TeacherConfig, student_tokenizer_path: str) -> None:
    """TeacherConfigError unless the teacher checkpoint exists and shares the student's vocabulary."""
    from verl_megatron.utils.tokenizer import hf_tokenizer

    path = config.model.path
    key = "algorithm.distill.teacher.model.path"
    if not path:
        raise TeacherConfigError(
            f"{key} is not set (algorithm.distill.enable=true needs a teacher checkpoint)"
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise TeacherConfigError(f"{key}='{path}' is not a Hugging Face checkpoint folder (no config.json)")
    teacher = hf_tokenizer(config.model.tokenizer_path or path).get_vocab()
    student = hf_tokenizer(student_tokenizer_path).get_vocab()
    if teacher != student:
        differ = sorted(set(teacher.items()) ^ set(student.items()))[:3]
        raise TeacherConfigError(
            f"{key}='{path}': the teacher's tokenizer ({len(teacher)} tokens) differs from the student's "
            f"({len(student)} tokens), e.g. {differ}; on-policy distillation needs one vocabulary "
            "(cross-tokenizer distillation is not supported yet)"
        )


def check_teacher_logits(config: TeacherConfig, student_path: str) -> None:
    """``loss: gkd_jsd`` compares the two models' logits column for column: TeacherConfigError
    unless their config.json vocab sizes agree (a shared tokenizer does not make them: Qwen2.5-7B
    pads its vocabulary to 152064, Qwen2.5-0.5B to 151936)."""
    from verl_megatron.models.config import load_hf_config

    teacher = load_hf_config(config.model.path).vocab_size
    student = load_hf_config(student_path).vocab_size
    if teacher != student:
        raise TeacherConfigError(
            f"algorithm.distill.loss=gkd_jsd compares logits over the whole vocabulary, but the teacher "
            f"({config.model.path}) has vocab_size {teacher} and the student ({student_path}) {student}; "
            "use algorithm.distill.loss=reverse_kl (log-probs of the sampled tokens only)"
        )


def teacher_layout(config: TeacherConfig, world_size: int, this_machine: bool = True) -> ParallelLayout:
    """The teacher's layout over ``world_size`` ranks, its model settings and (when its
    checkpoint is there; ``check_teacher`` names a missing one) its heads and layers checked on
    it: TeacherConfigError naming the ``algorithm.distill.teacher`` key. ``this_machine=False``
    leaves out its model settings (Transformer Engine and CUDA among them), as ``validate_config``
    does for the student's."""
    from verl_megatron.models.config import check_layout, load_hf_config, read_hf_architecture

    key = "algorithm.distill.teacher"
    try:
        layout = config.parallel.resolve(world_size)
        if os.path.isfile(os.path.join(os.path.expanduser(config.model.path), "config.json")):
            check_layout(layout, read_hf_architecture(load_hf_config(config.model.path)))
    except ParallelConfigError as err:
        raise TeacherConfigError(f"{key}.parallel: {err} ({key}.model.path='{config.model.path}')") from None
    if not this_machine:
        return layout
    try:
        config.model.validate(layout)
    except ModelConfigError as err:  # its messages name the key under "model."
        raise TeacherConfigError(f"{key}.{err}") from None
    return layout


class MegatronTeacher:
    """Frozen teacher log-probs [B, Tr] of a batch's responses; built and called on every rank."""

    def __init__(self, runtime: Runtime, config: TeacherConfig) -> None:
        from verl_megatron.distributed.parallel_state_slot import ParallelStateSlot
        from verl_megatron.models.builder import build_gpt_chunks
        from verl_megatron.models.config import load_hf_config
        from verl_megatron.models.convert import load_hf_weights

        self.config = config
        layout = teacher_layout(config, runtime.world_size)  # checked at start-up too
        self.slot = None if layout == runtime.layout else ParallelStateSlot(layout, runtime)
        self._runtime = runtime
        forward = RefConfig(
            log_prob_micro_batch_size_per_gpu=config.micro_batch_size_per_gpu,
            log_prob_use_dynamic_bsz=config.use_dynamic_bsz,
            log_prob_max_token_len_per_gpu=config.max_token_len_per_gpu,
            use_remove_padding=config.use_remove_padding,
        )
        with self.scope() as rt:
            chunks = build_gpt_chunks(load_hf_config(config.model.path), rt, config.model)
            load_hf_weights(chunks, config.model.path, rt, config.model)
            self.forward = MegatronRef(rt, forward, chunks)  # frozen: no gradients, no optimizer
        self.chunks = chunks
        self.offloader = Offloader()  # parks the teacher's weights between calls (``offload``)
        self.param_bytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        self._park()

    def scope(self) -> contextlib.AbstractContextManager[Runtime]:
        """The teacher's parallel state (its own slot, or the student's when the layouts agree)."""
        return self.slot.active() if self.slot is not None else contextlib.nullcontext(self._runtime)

    def _park(self) -> None:
        if self.config.offload:
            self.offloader.offload_model(self.chunks, grads=False)

    def compute_log_prob(self, data: DataProto) -> torch.Tensor:
        """log p_teacher [B, Tr] of ``data``'s response tokens at ``meta_info['temperature']``."""
        log_probs, _ = self._run(self.forward.compute_log_prob, data)
        return log_probs

    def compute_logits(self, data: DataProto) -> torch.Tensor:
        """The teacher's logits [B, Tr, V] before each response token (whole vocabulary, its dtype)."""
        return self._run(self.forward.compute_response_logits, data)

    def _run(self, forward, data: DataProto):
        """``forward(data)`` under the teacher's parallel state, its weights loaded for the call."""
        with self.scope():
            if self.config.offload:
                self.offloader.load_model(self.chunks)
            try:
                return forward(data)
            finally:
                self._park()

    def close(self) -> None:
        """Destroy the teacher's own process groups."""
        if self.slot is not None:
            self.slot.close()
