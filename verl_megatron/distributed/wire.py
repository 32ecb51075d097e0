"""Which tensor dtypes may be communicated: the guard every communication helper calls.

NCCL carries only the dtypes in PyTorch's ``ncclDataType`` map (``torch/csrc/distributed/c10d/
NCCLUtils.hpp``, PyTorch 2.x): int8, uint8, bool (as uint8), int32, int64, float16, bfloat16,
float32, float64 and the float8 types; any other (int16, uint16, uint32, uint64, ...) fails inside
``getNcclDataType`` ("Input tensor data type is not supported for NCCL process group" or, in older
releases, "Unconvertible NCCL type Short"). gloo carries more, so a CPU run would never see that
failure: the guard raises :class:`WireDtypeError` on every backend, before the call, so the CPU
tests catch what only a GPU job would otherwise hit.

NCCL carries float8 but does not reduce it: ProcessGroupNCCL's allreduce, allreduce_coalesced,
reduce_scatter, _reduce_scatter_base and reduce_scatter_tensor_coalesced refuse float8 ("Unsupported
Float8 type for NCCL reduction", "Float8 dtypes are not currenlty supported for NCCL reductions" in
older releases; e4m3fn / e5m2 pass only when PyTorch was built with an NCCL that has FP8), and its
reduce checks nothing while the type map sends those float8 types as uint8 (always the fnuz ones),
so the bytes would be summed as integers. The guard refuses float8 in every reduction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = [
    "FLOAT8_DTYPES",
    "NCCL_DTYPES",
    "WireDtypeError",
    "check_wire",
    "guard_torch_distributed",
    "wire_dtype",
]

NCCL_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)

# Carried by NCCL (as bytes), never reduced by it.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
)

# The smallest NCCL dtype that holds every value of an integer dtype NCCL lacks.
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


class WireDtypeError(TypeError):
    """A tensor of a dtype NCCL cannot carry was about to be communicated (a bug, not user input)."""


def check_wire(
    where: str, tensors: torch.Tensor | Iterable[torch.Tensor], *, reduction: bool = False
) -> None:
    """Raise WireDtypeError if any of ``tensors`` has a dtype outside :data:`NCCL_DTYPES`, or, for
    a ``reduction`` (all-reduce, reduce, reduce-scatter), a float8 dtype.

    ``where`` names the helper in the message. Called on every backend (gloo included).
    """
    for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        if tensor.dtype not in NCCL_DTYPES:
            raise WireDtypeError(
                f"{where}: a {tensor.dtype} tensor {tuple(tensor.shape)} cannot be communicated "
                f"(NCCL has no such type); convert it with wire_dtype() first"
            )
        if reduction and tensor.dtype in FLOAT8_DTYPES:
            raise WireDtypeError(
                f"{where}: a {tensor.dtype} tensor {tuple(tensor.shape)} cannot be reduced "
                f"(NCCL reduces no float8); reduce it in bfloat16 or float32"
            )


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to communicate a ``dtype`` tensor in: itself when NCCL carries it, else the
    smallest NCCL integer type that holds all its values (int16 -> int32, uint32 -> int64)."""
    if dtype in NCCL_DTYPES:
        return dtype
    if dtype not in _WIDER:
        raise WireDtypeError(f"no NCCL dtype holds every {dtype} value")
    return _WIDER[dtype]


# torch.distributed's tensor communication calls; their tensor arguments (alone or in lists)
# are what crosses the wire. Not isend/irecv: P2POp checks its op by identity against them
# (megatron's pipeline builds P2POp(torch.distributed.irecv, ...)), so a wrapper would be refused;
# the point-to-point tensors are checked where the ops are run, in batch_isend_irecv.
_CALLS = (
    "all_reduce", "broadcast", "send", "recv", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
    "scatter", "batch_isend_irecv", "all_reduce_coalesced", "_reduce_scatter_base",
)  # fmt: skip
# Those of them that reduce: no float8 (see the module's docstring).
_REDUCTIONS = frozenset({
    "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced",
    "_reduce_scatter_base",
})  # fmt: skip


def _tensors(values: Iterable[object]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif isinstance(getattr(item, "tensor", None), torch.Tensor):  # a P2POp
                    yield item.tensor


def guard_torch_distributed() -> None:
    """Make every torch.distributed tensor call of this process (the project's, megatron's)
    run the guard first. For test workers on gloo: a dtype NCCL refuses then fails the CPU test
    that sends it, wherever the call is. Idempotent."""
    import functools

    import torch.distributed as dist

    for name in _CALLS:
        call = getattr(dist, name, None)
        if call is None or getattr(call, "_wire_guarded", False):
            continue

        @functools.wraps(call)
        def guarded(*args, _call=call, _name=name, **kwargs):
            tensors = _tensors([*args, *kwargs.values()])
            check_wire(f"torch.distributed.{_name}", tensors, reduction=_name in _REDUCTIONS)
            return _call(*args, **kwargs)

        guarded._wire_guarded = True
        # Replacing torch.distributed's own functions (kept here in distributed/, on the allowlist of
        # tests/test_no_foreign_attributes.py): megatron and torch call them directly, so only a
        # process-wide wrapper sees every tensor sent, whichever library sends it.
        setattr(dist, name, guarded)
