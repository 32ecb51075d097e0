"""Build megatron model chunks, wrap them for data parallelism, and make their optimizer.

These are the layout-aware pieces shared by the actor, critic, reference and
tests: which pipeline stage (and virtual stage) a chunk is, DDP wrapping, the
optimizer with its LR scheduler, and hooking gradient finalisation into the
megatron schedule. Model *definition* (which GPTModel for which HF family)
lives in ``verl_megatron.models.builder``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verl_megatron.distributed import cpu_compat
from verl_megatron.distributed.parallel import Runtime

# make_chunk(pre_process, post_process, vp_stage) -> megatron module
ChunkFactory = Callable[[bool, bool, "int | None"], torch.nn.Module]


def build_chunks(runtime: Runtime, make_chunk: ChunkFactory) -> list[torch.nn.Module]:
    """One module per virtual pipeline stage held by this rank (one without vpp)."""
    from megatron.core import parallel_state as ps

    vpp = runtime.layout.vpp if (runtime.layout.vpp or 1) > 1 else None
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunk = make_chunk(pre, post, stage)
        cpu_compat.configure_model(chunk.config)
        chunks.append(chunk)
    return chunks


def wrap_ddp(
    chunks: list[torch.nn.Module],
    *,
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
    use_distributed_optimizer: bool = False,
    bucket_size: int | None = None,
) -> list[torch.nn.Module]:
    """Wrap each chunk in megatron's DistributedDataParallel (gradient buffers + dp all-reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk's buffer is bucketed for overlap; megatron does the same.
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def attach_schedule_hooks(chunks: list[torch.nn.Module]) -> None:
    """Let megatron's schedule finalise grads (dp all-reduce, tied embeddings) after backward."""
    from megatron.core.distributed import finalize_model_grads

    for chunk in chunks:
        config = _unwrap(chunk).config
        config.finalize_model_grads_func = finalize_model_grads
        if len(chunks) > 1:
            config.no_sync_func = [c.no_sync for c in chunks]
            config.grad_sync_func = [c.start_grad_sync for c in chunks]
        else:
            config.no_sync_func = chunks[0].no_sync


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


@dataclass
class OptimSettings:
    """Optimizer settings passed to megatron's ``get_megatron_optimizer``."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    optimizer: str = "adam"
    bf16: bool = False
    use_distributed_optimizer: bool = False


def build_optimizer(chunks: list[torch.nn.Module], settings: OptimSettings):
    """Megatron optimizer over all chunks (fp32 master weights; clipping by global norm)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if settings.use_distributed_optimizer and not torch.cuda.is_available():
        raise ValueError(
            "optim.use_distributed_optimizer=True needs CUDA (reduce-scatter and CUDA tensors); "
            "this machine has no GPU"
        )
    config = OptimizerConfig(
        optimizer=settings.optimizer,
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        bf16=settings.bf16,
        params_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, chunks)


def zero_grads(chunks: list[torch.nn.Module], optimizer) -> None:
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
