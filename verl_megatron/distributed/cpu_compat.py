"""Run megatron-core on a machine without CUDA.

megatron-core assumes a GPU in a handful of places (see
``shared/reference/megatron-on-cpu.md``): ``device="cuda"`` and
``device=torch.cuda.current_device()`` in tensor factories, ``.cuda()`` calls,
the CUDA RNG functions behind the tensor-parallel RNG tracker, streams/events,
a type assertion in gradient clipping, and the ``tensor.type()`` names by which
the mixed-precision (bf16) optimizer sorts parameters into fp32 and bf16 ones. This module covers exactly those,
and nothing is touched when CUDA is present: :func:`install` is a no-op there.

Everything is installed once per process by :func:`install`; the distributed
runtime calls it before megatron's parallel state is created.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_INSTALLED = False
_MODE: _CudaToCpuMode | None = None


def _is_cuda_device(device: Any) -> bool:
    # An int device index means "cuda:<index>" to torch factories.
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            # Pinned memory needs a CUDA driver.
            kwargs = {**kwargs, "pin_memory": False}
        # Only Tensor.to takes a device positionally; new_empty's positional ints are sizes.
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


# The float types megatron's mixed-precision optimizer accepts, by their CPU names.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaTypeNamesMode(TorchFunctionMode):
    """Makes ``tensor.type()`` name CPU float tensors as their CUDA counterparts.

    Entered only around megatron code that sorts parameters by ``type()`` string
    (fp32 vs bf16/fp16), so that sorting sees the dtype and not the device.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def _with_cuda_type_names(function: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _CudaTypeNamesMode():
            return function(*args, **kwargs)

    wrapped.__wrapped__ = function
    return wrapped


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def cpu_clip_grad_by_total_norm_fp32(
    parameters: list[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale gradients in place so their total norm is at most ``max_norm``.

    Same contract as megatron's ``clip_grad_by_total_norm_fp32``, whose only
    CPU problem is an assertion that each grad is a ``torch.cuda.FloatTensor``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise TypeError(f"gradient clipping expects float32/bfloat16/float64 grads, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _cpu_manual_seed(seed: int) -> None:
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = _cpu_set_rng_state
    cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.random.manual_seed = _cpu_manual_seed
    cuda.random.manual_seed_all = _cpu_manual_seed
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0


def _run_backward_in_mode(function_cls: type) -> None:
    """Make an autograd Function's backward see the device mapping.

    Torch function modes are not active while autograd runs a backward pass,
    and megatron's activation recomputation re-runs the forward (which builds
    ``device="cuda"`` tensors, e.g. the causal mask) inside backward.
    """
    original = function_cls.backward

    def backward(ctx, *grads):
        with _CudaToCpuMode():
            return original(ctx, *grads)

    function_cls.backward = staticmethod(backward)


def _patch_megatron() -> None:
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _cpu_get_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    mcore_optimizer.clip_grad_by_total_norm_fp32 = cpu_clip_grad_by_total_norm_fp32
    # bf16/fp16 mixed precision: the optimizer keeps fp32 main copies of the params it
    # finds to be 'torch.cuda.BFloat16Tensor'/'HalfTensor' and raises on any other name.
    mixed = mcore_optimizer.Float16OptimizerWithFloat16Params
    mixed.__init__ = _with_cuda_type_names(mixed.__init__)
    # The distributed optimizer sorts its shards the same way (fp32 / bf16 / fp16 by type name).
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _with_cuda_type_names(DistributedOptimizer.__init__)
    _run_backward_in_mode(mcore_random.CheckpointFunction)
    _run_backward_in_mode(mcore_random.CheckpointWithoutOutputFunction)
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    # Expert parallelism: the all-to-all's backward allocates its output on "the current device".
    _run_backward_in_mode(mappings._AllToAll)
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_split_sizes


def _cpu_split_sizes(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's MoE all-to-all dispatcher moves its split sizes to the host as NumPy arrays,
    but only from a CUDA tensor; a CPU tensor stays a tensor, which ``all_to_all_single``
    rejects as a list of sizes. Here CPU tensors become NumPy arrays too."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def configure_model(config: Any) -> None:
    """Adjust a megatron ModelParallelConfig for gloo point-to-point messages.

    With batched p2p (megatron's default) a rank posts its sends as
    [to prev, to next] and its receives as [from prev, from next]. With pp=2,
    prev and next are the same peer, and gloo matches messages between a pair
    by posting order on one communicator, so the interleaved (vpp) schedule's
    activation and gradient messages get swapped. The unbatched path sends each
    direction on its own communicator, which keeps them apart.
    """
    if _INSTALLED:
        config.batch_p2p_comm = False


def install(force: bool = False) -> bool:
    """Install the CPU compatibility layer once per process.

    Returns True when the layer is active. With CUDA present nothing is done
    (unless ``force``, used by tests that exercise the layer itself).
    """
    global _INSTALLED, _MODE
    if _INSTALLED:
        return True
    if torch.cuda.is_available() and not force:
        return False
    _patch_torch_cuda()
    _patch_megatron()
    _MODE = _CudaToCpuMode()
    # Entered for the life of the process: megatron builds CUDA tensors from
    # many call sites, at init and at every step.
    _MODE.__enter__()
    _INSTALLED = True
    logger.info("CUDA not available: megatron-core runs on CPU through verl_megatron.distributed.cpu_compat")
    return True


def is_installed() -> bool:
    return _INSTALLED
