"""Exact bytes of one rank's model state, read off the objects the job itself builds.

Each role is built by the trainer's own builders (``build_gpt_chunks``, LoRA, megatron's
``DistributedDataParallel`` and optimizer) inside a fake process group of the job's world size,
on the meta device: shard shapes, vocabulary and expert padding, the gradient buffers' and the
distributed optimizer's padding all come from megatron. Nothing is allocated.

What is counted (the categories a test sums from the real tensors of a CPU job):

- ``params``: every parameter's storage, once (with the distributed optimizer the trained
  parameters live in megatron's contiguous parameter buffer, padding included);
- ``grads``: megatron's gradient buffers (``main_grad``), padding included;
- ``master``: the optimizer's own fp32 copies of bf16 parameters (sharded over dp with the
  distributed optimizer);
- ``moments``: the optimizer state of every parameter it steps on the GPU (Adam: ``exp_avg`` and
  ``exp_avg_sq`` in the master parameter's dtype, and a float32 ``step``);
- ``host``: with ``optimizer_cpu_offload``, host memory of the parameters megatron's
  HybridDeviceOptimizer steps on the CPU (the first ``optimizer_offload_fraction`` of each
  optimizer's parameters by element count, in its order): their moments and step, a float32
  copy of each and a float32 gradient copy. The mixed-precision optimizer's fp32 masters of
  those parameters stay on the GPU (counted in ``master``), except with
  ``use_precision_aware_optimizer``: the distributed optimizer then keeps no masters and the
  hybrid one makes a float32 copy of each bf16 shard, in host memory for the offloaded
  parameters (their ``master`` is 0) and on the GPU for the others (counted in ``master``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from verl_megatron.distributed import state
from verl_megatron.distributed.fake_world import fake_runtime, meta_device
from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import ParallelLayout, Runtime

__all__ = ["RankPosition", "RoleSpec", "StateBytes", "build_role_state", "count_state"]

_ADAM_STEP_BYTES = 4  # torch's Adam keeps its step count as a float32 scalar tensor per parameter


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one role's model state on one rank."""

    params: int = 0
    grads: int = 0
    master: int = 0
    moments: int = 0
    host: int = 0
    """Not on the GPU: the CPU optimizer step's state (not in ``optimizer`` or ``total``)."""

    @property
    def optimizer(self) -> int:
        return self.master + self.moments

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.moments


@dataclass(frozen=True)
class RankPosition:
    """Where a rank sits in the layout, as megatron's parallel state reports it."""

    rank: int
    tp: int
    pp: int
    dp: int
    ep: int

    def label(self) -> str:
        return f"rank {self.rank} (tp {self.tp}, pp {self.pp}, ep {self.ep}, dp {self.dp})"


@dataclass(frozen=True)
class RoleSpec:
    """One model of the job: its HF config, model settings, layout and how it is trained.

    ``optim`` is None for a model that is only run (reference, reward model); else the
    role's OptimConfig (``use_distributed_optimizer`` etc.).
    """

    name: str
    hf_config: Any
    model: Any  # models.config.ModelConfig
    layout: ParallelLayout
    value_head: bool = False
    optim: Any = None
    lora: bool = False


def _megatron_buffers(chunk: torch.nn.Module) -> list[Any]:
    """megatron DDP's parameter-and-gradient buffers of a wrapped chunk (none unwrapped)."""
    if getattr(chunk, "ddp_config", None) is None:
        return []
    return [*chunk.buffers, *chunk.expert_parallel_buffers]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _master_bytes(inner: Any) -> int:
    groups = getattr(inner, "fp32_from_float16_groups", None)  # Float16OptimizerWithFloat16Params
    if groups is None:
        groups = getattr(inner, "shard_fp32_from_float16_groups", None) or []  # DistributedOptimizer
    return sum(_nbytes(p) for group in groups for p in group)


def _offloaded(params: list[torch.Tensor], offload_fraction: float) -> set[int]:
    """ids of the parameters megatron's HybridDeviceOptimizer steps on the host: the first ones
    in its order while the offloaded element count is below ``offload_fraction`` of the total."""
    threshold = offload_fraction * sum(p.numel() for p in params)
    out, offloaded = set(), 0
    for p in params:
        if offloaded < threshold:
            offloaded += p.numel()
            out.add(id(p))
    return out


def _moment_bytes(inner: Any, offload_fraction: float) -> tuple[int, int]:
    """(GPU, host) bytes of the Adam state, the first ``offload_fraction`` of the parameters (by
    element count, as megatron's HybridDeviceOptimizer picks them) stepped on the host."""
    torch_optimizer = inner.optimizer
    if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise NotImplementedError(f"optimizer state of {type(torch_optimizer).__name__} is not modelled")
    params = [p for group in torch_optimizer.param_groups for p in group["params"]]
    offloaded = _offloaded(params, offload_fraction)
    gpu = host = 0
    for p in params:
        moments = 2 * _nbytes(p) + _ADAM_STEP_BYTES
        if id(p) in offloaded:
            host += moments + 2 * 4 * p.numel()  # + its float32 copy and float32 gradient copy
        else:
            gpu += moments
    return gpu, host


def _gpu_master_bytes(inner: Any, offload_fraction: float, precision_aware: bool) -> int:
    """The masters on the GPU; with the precision-aware optimizer, none of the offloaded ones
    (their float32 copy in host memory is counted in ``host``)."""
    if not precision_aware:
        return _master_bytes(inner)
    offloaded = _offloaded([p for g in inner.optimizer.param_groups for p in g["params"]], offload_fraction)
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or []
    return sum(_nbytes(p) for group in groups for p in group if id(p) not in offloaded)


def count_state(
    chunks: list[torch.nn.Module],
    optimizer: Any = None,
    offload_fraction: float = 0.0,
    precision_aware: bool = False,
) -> StateBytes:
    """The bytes of built (possibly meta) chunks and their megatron optimizer, by category;
    ``offload_fraction`` and ``precision_aware``: the optimizer's, when built without its CPU
    step and as a plain distributed optimizer (see ``host``)."""
    buffers = [b for chunk in chunks for b in _megatron_buffers(chunk)]
    in_param_buffer = {id(p) for b in buffers if b.param_data is not None for p in b.params}
    loose = {id(p): p for chunk in chunks for p in unwrap(chunk).parameters() if id(p) not in in_param_buffer}
    params = sum(_nbytes(b.param_data) for b in buffers if b.param_data is not None)
    params += sum(_nbytes(p) for p in loose.values())
    grads = sum(_nbytes(b.grad_data) for b in buffers)
    if optimizer is None:
        return StateBytes(params=params, grads=grads)
    inners = _inner_optimizers(optimizer)
    moments = [_moment_bytes(o, offload_fraction) for o in inners]
    return StateBytes(
        params=params,
        grads=grads,
        master=sum(_gpu_master_bytes(o, offload_fraction, precision_aware) for o in inners),
        moments=sum(gpu for gpu, _ in moments),
        host=sum(host for _, host in moments),
    )


def _build(spec: RoleSpec, runtime: Runtime, use_distributed_optimizer: bool | None) -> StateBytes:
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.lora import apply_configured_lora
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.workers.lr_schedule import optim_settings

    chunks = build_gpt_chunks(spec.hf_config, runtime, spec.model, value_head=spec.value_head)
    if spec.lora:
        chunks = apply_configured_lora(chunks, spec.model, runtime.seed)
    if spec.optim is None:
        return count_state(chunks)
    optim = spec.optim
    if use_distributed_optimizer is not None and use_distributed_optimizer != optim.use_distributed_optimizer:
        optim = replace(
            optim,
            use_distributed_optimizer=use_distributed_optimizer,
            overlap_param_gather=False,
            use_precision_aware_optimizer=optim.use_precision_aware_optimizer and use_distributed_optimizer,
        )
    # The CPU step is counted from the plain build (megatron's hybrid optimizer needs CUDA
    # parameters to offload, its precision-aware mode Transformer Engine; count_state
    # reproduces their split).
    fraction = optim.optimizer_offload_fraction if optim.optimizer_cpu_offload else 0.0
    plain = replace(optim, optimizer_cpu_offload=False, use_precision_aware_optimizer=False)
    settings = optim_settings(plain, bf16=spec.model.dtype == "bfloat16")
    chunks = wrap_ddp(chunks, settings)
    return count_state(
        chunks, build_optimizer(chunks, settings), fraction, optim.use_precision_aware_optimizer
    )


def build_role_state(
    spec: RoleSpec,
    world_size: int,
    rank: int,
    distributed_optimizer: tuple[bool, ...] = (),
    *,
    configured: bool = True,
) -> tuple[RankPosition, dict[bool | None, StateBytes]]:
    """Build ``spec``'s model at ``rank`` of a ``world_size`` job on the meta device.

    Returns the rank's position and its state bytes: under key None as configured (unless
    ``configured`` is false), and under each value of ``distributed_optimizer`` with
    ``use_distributed_optimizer`` set so (trained roles).
    """
    with fake_runtime(spec.layout, world_size, rank) as runtime:
        position = RankPosition(
            rank=rank, tp=runtime.tp_rank, pp=runtime.pp_rank, dp=runtime.dp_rank, ep=state.rank("ep")
        )
        variants: list[bool | None] = [None] * configured
        variants += list(distributed_optimizer if spec.optim is not None else ())
        with meta_device():
            return position, {variant: _build(spec, runtime, variant) for variant in variants}
