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

from verl_megatron.distributed import cpu_compat, state
from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.errors import WorkerConfigError

# make_chunk(pre_process, post_process, vp_stage) -> megatron module
ChunkFactory = Callable[[bool, bool, "int | None"], torch.nn.Module]


def build_chunks(runtime: Runtime, make_chunk: ChunkFactory) -> list[torch.nn.Module]:
    """One module per virtual pipeline stage held by this rank (one without vpp)."""
    vpp = runtime.layout.vpp if (runtime.layout.vpp or 1) > 1 else None
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = state.is_pp_first_stage(stage)
        post = state.is_pp_last_stage(stage)
        chunk = make_chunk(pre, post, stage)
        cpu_compat.configure_model(chunk.config)
        chunks.append(chunk)
    return chunks


def ddp_config(settings: OptimSettings):
    """megatron's DistributedDataParallelConfig for ``settings``: the one place that ties the
    gradient buffers and their reduction to the optimizer that consumes them."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        bucket_size=settings.bucket_size,
    )


def wrap_ddp(chunks: list[torch.nn.Module], settings: OptimSettings | None = None) -> list[torch.nn.Module]:
    """Wrap each chunk in megatron's DistributedDataParallel (gradient buffers + dp reduction).

    ``settings`` must be the ones later passed to :func:`build_optimizer` (it checks).
    """
    from megatron.core.distributed import DistributedDataParallel

    config = ddp_config(settings or OptimSettings())
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=config,
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
        config = unwrap(chunk).config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        # As megatron's training loop: the interleaved schedule starts a chunk's reduction early
        # only when it can overlap. Without overlap, finalize_model_grads reduces every bucket
        # anyway, so an early start would reduce twice (a second reduce-scatter corrupts the
        # distributed optimizer's shards).
        overlap = any(
            getattr(c, "ddp_config", None) is not None and c.ddp_config.overlap_grad_reduce for c in chunks
        )
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if overlap and len(chunks) > 1 else None


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
    """Shard optimizer state and fp32 master weights over dp ranks (reduce-scatter grads, all-gather params)."""
    overlap_grad_reduce: bool = False
    """Reduce gradient buckets during the backward pass instead of after it."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated params during the next forward (pre-hooks)."""
    grad_reduce_in_fp32: bool = True
    """Gradient buffers (and their reduction) in float32 whatever the params' dtype."""
    bucket_size: int | None = None
    """Elements per gradient bucket (None: megatron's default)."""
    optimizer_cpu_offload: bool = False
    """Step ``optimizer_offload_fraction`` of the parameters on the CPU (megatron's HybridDeviceOptimizer)."""
    optimizer_offload_fraction: float = 1.0
    use_precision_aware_optimizer: bool = False
    """megatron's precision-aware optimizer (with the CPU step: no fp32 masters on the GPU)."""


def _check_ddp_matches(chunks: list[torch.nn.Module], settings: OptimSettings) -> None:
    for chunk in chunks:
        wrapped = getattr(chunk, "ddp_config", None)
        if wrapped is None:
            continue
        for name in ("use_distributed_optimizer", "overlap_param_gather"):
            if getattr(wrapped, name) != getattr(settings, name):
                raise ValueError(
                    f"optim.{name}={getattr(settings, name)} but the model was wrapped with {name}="
                    f"{getattr(wrapped, name)}: pass the same OptimSettings to wrap_ddp and build_optimizer"
                )


def check_cpu_offload_device(where: str = "optim") -> None:
    """Refuse ``optimizer_cpu_offload`` without CUDA: megatron's HybridDeviceOptimizer steps host
    copies of CUDA parameters, and a parameter already on the host has none (its step raises)."""
    if not torch.cuda.is_available():
        raise WorkerConfigError(
            f"{where}.optimizer_cpu_offload=true needs CUDA parameters (megatron's HybridDeviceOptimizer "
            "copies them to the host to step them there); on this CPU-only machine set it to false"
        )


def check_precision_aware_support(where: str = "optim") -> None:
    """Refuse ``use_precision_aware_optimizer`` without Transformer Engine: megatron-core 0.16.1's
    OptimizerConfig reads TE's version for it (a TypeError when TE is not installed)."""
    from megatron.core.utils import get_te_version

    if get_te_version() is None:
        raise WorkerConfigError(
            f"{where}.use_precision_aware_optimizer=true needs Transformer Engine installed (megatron reads "
            "its version to build the optimizer); install it or set the key to false"
        )


def optimizer_config(settings: OptimSettings):
    """megatron's OptimizerConfig for ``settings``."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
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
        overlap_param_gather=settings.overlap_param_gather,
        optimizer_cpu_offload=settings.optimizer_cpu_offload,
        optimizer_offload_fraction=settings.optimizer_offload_fraction
        if settings.optimizer_cpu_offload
        else 0.0,
        # As verl's script: one CPU optimizer per parameter, its grads copied to the host while the others step.
        overlap_cpu_optimizer_d2h_h2d=settings.optimizer_cpu_offload,
        use_precision_aware_optimizer=settings.use_precision_aware_optimizer,
    )


def build_optimizer(chunks: list[torch.nn.Module], settings: OptimSettings):
    """Megatron optimizer over all chunks (fp32 master weights; clipping by global norm)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if settings.optimizer_cpu_offload:
        check_cpu_offload_device()
    if settings.use_precision_aware_optimizer:
        check_precision_aware_support()
    if settings.overlap_param_gather and not settings.use_distributed_optimizer:
        raise ValueError(
            "optim.overlap_param_gather=True needs optim.use_distributed_optimizer=True "
            "(without it every rank holds the whole updated parameters: nothing to gather)"
        )
    _check_ddp_matches(chunks, settings)
    optimizer = get_megatron_optimizer(optimizer_config(settings), chunks)
    fuse_cpu_adam(optimizer)
    return optimizer


def fuse_cpu_adam(optimizer) -> None:
    """Step torch's Adam/AdamW in its fused CPU kernel where every parameter it updates is on the CPU.

    Without Transformer Engine or apex megatron builds ``torch.optim.AdamW`` with torch's defaults;
    on the CPU those pick the single-tensor path (the foreach kernels are CUDA-only), about seven
    elementwise passes over each parameter, gradient and moment. ``fused=True`` (the flag megatron
    sets for its own CPU-offload optimizer) updates each element in one pass: the same update up
    to float32 rounding, ~5x less CPU time (1.04 -> 0.20 s for 150M parameters, one thread).
    """
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam) or inner.defaults.get("differentiable"):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if params and all(p.device.type == "cpu" and p.is_floating_point() for p in params):
            for group in inner.param_groups:
                group["fused"] = True


def gather_updated_params(chunks: list[torch.nn.Module]) -> None:
    """Complete the distributed optimizer's parameter all-gather now (collective over dp).

    With ``overlap_param_gather`` the updated parameters reach every rank only in the next
    forward's pre-hooks; code that reads whole parameters outside a forward (weight sync to an
    inference engine, checkpoints) calls this first. A no-op otherwise, and for a chunk gathered
    since its last gradient sync (the guard, a weight send and a checkpoint of one step gather once
    between them, not once each).
    """
    for chunk in chunks:
        config = getattr(chunk, "ddp_config", None)
        overlapped = config is not None and config.use_distributed_optimizer and config.overlap_param_gather
        if overlapped and not _params_gathered(chunk):
            chunk.start_param_sync(force_sync=True)


def _params_gathered(chunk: torch.nn.Module) -> bool:
    """Every bucket group of a DDP chunk finished an all-gather since megatron last cleared its
    ``param_gather_dispatched`` (at each gradient sync, i.e. before every optimizer step)."""
    groups = [*getattr(chunk, "bucket_groups", ()), *getattr(chunk, "expert_parallel_bucket_groups", ())]
    return bool(groups) and all(g.param_gather_dispatched and g.param_gather_handle is None for g in groups)


def zero_grads(chunks: list[torch.nn.Module], optimizer) -> None:
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
