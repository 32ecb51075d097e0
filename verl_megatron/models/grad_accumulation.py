"""Weight gradients accumulated straight into megatron's gradient buffer, on the CPU.

megatron's DistributedDataParallel keeps each parameter's gradient in one flat buffer
(``param.main_grad``). Without its CUDA-only ``gradient_accumulation_fusion``, a linear layer's
backward allocates a fresh weight gradient, autograd hands it to the parameter, and DDP's hook
adds it into the buffer and frees it: per micro-batch, a new allocation (on the CPU, fresh pages
the kernel has to fault in) and an extra read-modify-write pass over every weight. Here the
weight gradient's matmul adds its product into the buffer itself (``main_grad.addmm_``, the
GEMM's own accumulate): no temporary, no second pass. The update equals DDP's up to float32
rounding (the product is summed into the buffer inside the GEMM instead of after it).

:func:`accumulate_into_main_grad` switches megatron's column/row parallel linears of
DDP-wrapped chunks for the duration of a ``with`` block (an update: forward, backward, and any
recomputed forward inside backward) and restores them after, so rollout and log-prob passes
keep their own matmuls. It switches nothing where the fused path would not be megatron's:

- a chunk not wrapped by DDP, or wrapped with ``overlap_grad_reduce`` (DDP's per-parameter
  hook must then see every gradient to start the bucket's reduction);
- a parameter off the CPU (the GPU path is megatron's own fusion), frozen, or whose buffer is
  not float32 (bf16 gradient buffers keep DDP's float32 accumulation order);
- a layer whose matmul is already replaced (the batch-invariant kernels of bitwise parity),
  expert layers with explicit communication, and sequence-parallel calls (they fall through to
  megatron's implementation per call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from verl_megatron.distributed.modules import unwrap

__all__ = ["accumulate_into_main_grad", "fusable_chunks"]


class _AccumulatingLinear(torch.autograd.Function):
    """y = x @ weight.T; backward adds grad.T @ x into ``main_grad`` and gives the weight no
    gradient of its own (DDP's hook then has nothing to add)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # Not saved for backward: it is the DDP buffer's view, which the backward updates in place.
        ctx.main_grad = main_grad
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.main_grad.addmm_(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        return grad_x, None, None


class _FusedWgradImpl:
    """Stands in for megatron's ``_forward_impl`` (same arguments) while an update runs."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **kwargs):
        # megatron passes everything by keyword; its two implementations order them differently.
        if (
            kwargs.get("sequence_parallel")
            or kwargs.get("grad_output_buffer") is not None
            or not _accumulates(weight)
        ):
            return self.original(input=input, weight=weight, bias=bias, **kwargs)
        if kwargs.get("allreduce_dgrad"):
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            # Forward: identity; backward: the input gradient all-reduced over tp (megatron's order).
            input = copy_to_tensor_model_parallel_region(input, group=kwargs.get("tp_group"))
        out = _AccumulatingLinear.apply(input, weight, weight.main_grad)
        return out if bias is None else out + bias


class _AccumulatingEmbedding(torch.autograd.Function):
    """Rows of ``weight`` at ``ids``; backward adds each row's gradient into ``main_grad`` at its
    id (a dense embedding backward would zero a whole [V, H] gradient per micro-batch first)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        ctx.main_grad.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None, None


class _FusedEmbeddingForward:
    """Stands in for a vocabulary-parallel embedding's ``forward`` while an update runs: at tp=1
    without sequence-parallel scatter the lookup is the whole forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.original = module.forward

    def __call__(self, input_: torch.Tensor) -> torch.Tensor:
        module = self.module
        if module.tp_group.size() > 1 or module.reduce_scatter_embeddings or not _accumulates(module.weight):
            return self.original(input_)
        return _AccumulatingEmbedding.apply(input_, module.weight, module.weight.main_grad)


def _accumulates(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s gradient may go straight into its DDP buffer here."""
    main_grad = getattr(weight, "main_grad", None)
    return (
        weight.requires_grad
        and main_grad is not None
        and main_grad.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
    )


def fusable_chunks(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The DDP-wrapped chunks of ``chunks`` whose gradients may skip DDP's per-parameter hook."""
    return [
        chunk
        for chunk in chunks
        if getattr(chunk, "ddp_config", None) is not None and not chunk.ddp_config.overlap_grad_reduce
    ]


@contextlib.contextmanager
def accumulate_into_main_grad(chunks: Sequence[torch.nn.Module]) -> Iterator[int]:
    """Within the context, the column/row parallel linears and vocabulary-parallel embeddings
    of ``chunks`` add their weight gradients into DDP's buffer (see the module doc); yields how
    many layers were switched."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    switched: list[tuple[torch.nn.Module, str]] = []
    for chunk in fusable_chunks(chunks):
        for module in unwrap(chunk).modules():
            if (
                isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                and "_forward_impl" not in vars(module)  # batch-invariant kernels stay
                and not getattr(module, "explicit_expert_comm", False)
            ):
                module._forward_impl = _FusedWgradImpl(module._forward_impl)
                switched.append((module, "_forward_impl"))
            elif type(module) is VocabParallelEmbedding and "forward" not in vars(module):
                module.forward = _FusedEmbeddingForward(module)
                switched.append((module, "forward"))
    try:
        yield len(switched)
    finally:
        for module, name in switched:
            delattr(module, name)
