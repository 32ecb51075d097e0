"""Weight gradients accumulated straight into megatron's gradient buffer, on the CPU.

megatron's DistributedDataParallel keeps each parameter's gradient in one flat buffer
(``param.main_grad``). Without its CUDA-only ``gradient_accumulation_fusion``, a linear layer's
backward allocates a fresh weight gradient, autograd hands it to the parameter, and DDP's hook
adds it into the buffer and frees it: per micro-batch, a new allocation (on the CPU, fresh pages
the kernel has to fault in) and an extra read-modify-write pass over every weight. Here the
weight gradient's matmul adds its product into the buffer itself (``main_grad.addmm_``, the
GEMM's own accumulate): no temporary, no second pass. The update equals DDP's up to float32
rounding (the product is summed into the buffer inside the GEMM instead of after it).

The layers that use these kernels are ours (``models/matmul_route.py``: megatron's column/row
parallel linears and vocabulary-parallel embedding, subclassed, consulting a route object the
builder hands them); ``matmul_route.accumulate_into_main_grad`` turns their route on for the
duration of a ``with`` block (an update: forward, backward, and any recomputed forward inside
backward), so rollout and log-prob passes keep megatron's matmuls. Per call the route falls
through to megatron's implementation wherever the fused path would not be megatron's:

- a chunk not wrapped by DDP, or wrapped with ``overlap_grad_reduce`` (DDP's per-parameter
  hook must then see every gradient to start the bucket's reduction);
- a parameter off the CPU (the GPU path is megatron's own fusion), frozen, or whose buffer is
  not float32 (bf16 gradient buffers keep DDP's float32 accumulation order);
- a layer whose matmul is already replaced (the batch-invariant kernels of bitwise parity),
  expert layers with explicit communication, and sequence-parallel calls (they fall through to
  megatron's implementation per call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["accumulates", "embedding_into_main_grad", "fusable_chunks", "linear_into_main_grad"]


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


def linear_into_main_grad(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    allreduce_dgrad: bool,
    tp_group: torch.distributed.ProcessGroup | None,
) -> torch.Tensor:
    """megatron's linear (input [..., K] @ weight [N, K].T + bias) for a weight that
    :func:`accumulates`, without sequence parallelism: the weight gradient goes into ``main_grad``."""
    if allreduce_dgrad:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        # Forward: identity; backward: the input gradient all-reduced over tp (megatron's order).
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
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


def embedding_into_main_grad(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` (one that :func:`accumulates`) at ``ids``; the gradient goes into ``main_grad``."""
    return _AccumulatingEmbedding.apply(ids, weight, weight.main_grad)


def accumulates(weight: torch.Tensor) -> bool:
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
