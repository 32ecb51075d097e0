"""Linear layers with oneDNN-packed weights for decoding on CPU (float32).

A decoding step multiplies a few dozen rows (one per sequence) by every weight matrix. At those
sizes the plain ``torch.matmul`` path re-lays-out the weight for every call and reaches about
half of the machine's matmul rate; a weight packed once into oneDNN's blocked layout does not
(measured on the 2-core CI machine, 64 rows, float32: the [512 -> 32000] LM head 115 vs 65
GFLOP/s, a [512 -> 2752] MLP projection 115 vs 75). The decoder's weights do not change during
one generate call, so :func:`packed_linears` packs each weight once on first use (about 50 ms for
a 16M-parameter LM head) and keeps the packed copies for the call.

Only the matrix multiply changes: the layer's own ``forward`` still does its tensor-parallel
communication, bias handling and output gathering, and LoRA's forward hooks still run, because
the swap is of megatron's per-layer ``_forward_impl`` (the function it calls for the matmul).
Layers whose ``_forward_impl`` is already replaced (the batch-invariant kernels of bitwise
parity) keep theirs, so parity is untouched. The packed product differs from ``torch.matmul``
only by float32 rounding (a different summation order).

Memory: the packed copies double the weights' memory for the duration of the call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

__all__ = ["PackedMatmul", "pack_weight", "packed_linears", "packing_available"]

# Rows the packed layout is tuned for: a decoding batch. The layout barely depends on it
# (16..4096 rows measured within 10% of each other at 8, 64 and 512 rows).
_ROWS_HINT = 64


@functools.cache
def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear and it computes a plain linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.linspace(-1.0, 1.0, 24).reshape(6, 4)
        x = torch.linspace(-2.0, 2.0, 12).reshape(3, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, x @ weight.t(), atol=1e-5))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32, CPU) in oneDNN's blocked layout, for ``_linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)


class PackedMatmul:
    """Stands in for megatron's ``_forward_impl`` (same arguments) in forward-only use."""

    def __init__(self, original) -> None:
        self.original = original
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args, **kwargs):
        if (
            torch.is_grad_enabled()
            or kwargs.get("sequence_parallel")
            or input.dtype != torch.float32
            or weight.dtype != torch.float32
            or input.device.type != "cpu"
        ):
            return self.original(input, weight, bias, *args, **kwargs)
        entry = self.packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            # The weight itself is kept with its packed copy, so the id cannot be reused.
            entry = (weight, pack_weight(weight.detach()))
            self.packed[id(weight)] = entry
        rows = input.reshape(-1, input.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, entry[1], bias, "none", [], "")
        return out.view(*input.shape[:-1], out.shape[-1])


def _on_cpu(module: torch.nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters(recurse=False))


@contextlib.contextmanager
def packed_linears(chunks: Sequence[torch.nn.Module]) -> Iterator[int]:
    """Within the context, megatron's column/row parallel linears of ``chunks`` multiply with
    packed weights when they run on CPU in float32 without autograd; yields how many layers
    were switched (0 where packing is unavailable). The weights must not change inside."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    switched: list[torch.nn.Module] = []
    if packing_available():
        for chunk in chunks:
            for module in chunk.modules():
                if (
                    isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                    and "_forward_impl" not in vars(module)  # batch-invariant kernels stay
                    and not getattr(module, "explicit_expert_comm", False)
                    and _on_cpu(module)
                ):
                    module._forward_impl = PackedMatmul(module._forward_impl)
                    switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module._forward_impl
