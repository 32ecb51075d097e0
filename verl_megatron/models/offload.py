"""Move model weights, gradients and optimizer state out of GPU memory between stages.

When the rollout engine needs the GPU, the trainer parks the training state
in host memory and brings it back before the next update (verl's
``param_offload``, ``grad_offload`` and ``optimizer_offload``):

- parameters are copied to (pinned) host memory; parameters that live in a
  megatron DDP parameter buffer (distributed optimizer) move as the whole
  buffer, whose GPU storage is then released while every view stays valid;
- gradient buffers are released without a copy, by megatron's own
  ``_ParamAndGradBuffer.offload_to_cpu(move_grads=True)`` / ``reload_from_cpu``: offloading
  happens after the optimizer step, when gradients are spent, and they come back zeroed;
- optimizer state (Adam moments) and fp32 master weights are copied to host.

Host copies are allocated (pinned) once and reused by every later offload. Kept here rather
than megatron's: its buffer parameter offload copies with ``.cpu()`` (an alias, not a copy,
when the buffer is on the host, so its bookkeeping cannot be exercised on CPU), and its
optimizer ``offload_to_cpu`` moves ``param_groups`` tensors, which for the fp32 optimizer
are the model's own parameters and for the fp32 distributed optimizer views of its parameter
buffer that ``restore_from_cpu`` would not re-attach.

The state of a move (where a parked tensor returns, its reused host copy) is kept by an
:class:`Offloader` that the caller owns, never on the tensors, buffers or optimizers.

On a machine without CUDA everything already lives in host memory: the
public methods move nothing, log that once, and return a report saying so.
The move itself is written for any pair of devices (``host``/``home``), so its
bookkeeping is tested on CPU with copies standing in for transfers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from verl_megatron.distributed.modules import unwrap

logger = logging.getLogger(__name__)

_NOTICED: set[str] = set()


@dataclass
class OffloadReport:
    """What one offload or load call did."""

    moved_bytes: int = 0
    """Bytes copied between devices."""
    freed_bytes: int = 0
    """Bytes released without a copy (gradient buffers) or re-allocated by a load."""
    tensors: int = 0
    """Tensors moved, released or re-allocated."""
    skipped: str | None = None
    """Why nothing was done (no CUDA, already offloaded), None when work was done."""


def _ddp_buffers(chunks: list[torch.nn.Module]) -> list:
    """megatron DDP's parameter/gradient buffers (dense and expert-parallel) of every chunk."""
    buffers = []
    for chunk in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            # On a plain nn.Module "buffers" is the method; megatron DDP shadows it with a list.
            found = getattr(chunk, attr, None)
            if isinstance(found, (list, tuple)):
                buffers += list(found)
    return buffers


def model_tensors(chunks: list[torch.nn.Module]) -> tuple[list, list[torch.nn.Parameter]]:
    """(DDP buffers, parameters not stored in a DDP parameter buffer) of ``chunks``.

    Without the distributed optimizer megatron DDP keeps only a gradient
    buffer, so every parameter is its own tensor and moves on its own.
    """
    buffers = _ddp_buffers(chunks)
    in_buffer = {id(p) for b in buffers if getattr(b, "param_data", None) is not None for p in b.params}
    loose = [p for chunk in chunks for p in unwrap(chunk).parameters() if id(p) not in in_buffer]
    return buffers, loose


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def _master_params(optimizer) -> Iterator[torch.Tensor]:
    """fp32 master copies held by megatron's mixed-precision optimizers (none for FP32Optimizer).

    FP32Optimizer steps the model's own parameters: those belong to the
    model and move with :func:`offload_model`, never here.
    """
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for sub in subs:
        # Not "shard_fp32_groups": the distributed optimizer's fp32 shards are
        # views of the model's own parameter buffer, which offload_model moves.
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(sub, attr, None) or []:
                yield from group


def optimizer_tensors(optimizer) -> list[tuple[dict, str]]:
    """(container, key) of every optimizer state tensor (``container[key]`` is the tensor)."""
    slots = []
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            # "step" is a CPU scalar in torch's Adam unless capturable; it stays where it is.
            slots += [(state, k) for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
    return slots


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_host(t: torch.Tensor, host: torch.device, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of ``t``, written into ``reuse`` (the previous offload's copy) when it fits.

    Pinned host memory is allocated once per tensor and kept across offloads: pinning is slow
    and pinned pages are a scarce resource.
    """
    if reuse is not None and reuse.shape == t.shape and reuse.dtype == t.dtype and reuse.device == host:
        return reuse.copy_(t)
    if t.is_cuda and host.type == "cpu":
        # Pinned pages: the copy back to the GPU runs at full bus speed.
        out = torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=True)
        return out.copy_(t)
    # copy=True: on CPU (tests) this makes the move observable as a new storage.
    return t.to(host, copy=True)


def _no_cuda(tensors: list[torch.Tensor], what: str) -> OffloadReport | None:
    if any(t.is_cuda for t in tensors):
        return None
    reason = "no tensor is on a CUDA device: it already lives in host memory"
    if what not in _NOTICED:
        _NOTICED.add(what)
        logger.info("%s: %s, nothing moved", what, reason)
    return OffloadReport(skipped=reason)


# ------------------------------------------------------------------- offloader


class Offloader:
    """Parks models and optimizers in host memory and brings them back; remembers what it moved.

    Its owner (the trainer for the rollout phase, a teacher for its own weights) keeps one for
    the whole run and passes it where parking happens. The bookkeeping (the device a parked
    tensor returns to, the host copies reused by the next offload, a released buffer's size)
    lives here, keyed weakly by the parameters, buffers and optimizers: nothing is written on
    those objects, and an entry goes when its key does.
    """

    def __init__(self) -> None:
        self._homes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parked parameter / buffer / optimizer -> the device it returns to."""
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parameter / buffer -> its host copy; optimizer -> its host copies in slot order. Kept
        after a load, for the next offload to write into."""
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parked buffer -> its parameter storage's size before it was released."""

    # ------------------------------------------------------------------- model

    def offload_model(self, chunks: list[torch.nn.Module], grads: bool = True) -> OffloadReport:
        """Copy parameters to host memory and (with ``grads``) release gradient buffers.

        A no-op on CPU. Call :meth:`load_model` before the next forward pass.
        """
        _, loose = model_tensors(chunks)
        buffered = [b.param_data for b in _ddp_buffers(chunks) if getattr(b, "param_data", None) is not None]
        skipped = _no_cuda(loose + buffered, "offload_model")
        return skipped or self._offload_model(chunks, grads, torch.device("cpu"))

    def load_model(self, chunks: list[torch.nn.Module]) -> OffloadReport:
        """Bring back what :meth:`offload_model` moved; gradient buffers come back zeroed."""
        report = self._load_model(chunks)
        if report.tensors == 0:
            _, loose = model_tensors(chunks)
            return _no_cuda([p.data for p in loose], "load_model") or report
        return report

    def _offload_model(self, chunks: list[torch.nn.Module], grads: bool, host: torch.device) -> OffloadReport:
        report = OffloadReport()
        buffers, loose = model_tensors(chunks)
        for buffer in buffers:
            param_data = getattr(buffer, "param_data", None)
            if param_data is not None and buffer not in self._homes:
                # Every parameter is a view of param_data: keep the storage object,
                # copy it out, shrink it to nothing; the views come back with it.
                self._homes[buffer] = param_data.device
                copy = _to_host(param_data, host, self._host.get(buffer))
                self._host[buffer] = copy
                self._sizes[buffer] = param_data.untyped_storage().size()
                param_data.untyped_storage().resize_(0)
                report.moved_bytes += _nbytes(copy)
                report.tensors += 1
            grad_data = getattr(buffer, "grad_data", None)
            if grads and grad_data is not None and grad_data.untyped_storage().size() > 0:
                # megatron's own release (storage resized to 0, views kept); it records the size.
                freed = grad_data.untyped_storage().nbytes()
                buffer.offload_to_cpu(move_params=False, move_grads=True)
                report.freed_bytes += freed
                report.tensors += 1
        for param in loose:
            if param in self._homes:
                continue
            self._homes[param] = param.device
            param.data = _to_host(param.data, host, self._host.get(param))
            self._host[param] = param.data
            report.moved_bytes += _nbytes(param.data)
            report.tensors += 1
            if grads and param.grad is not None:
                # Spent after the step. Under megatron DDP .grad is an alias of
                # main_grad (the optimizer sets it), released with the grad buffer.
                if not hasattr(param, "main_grad"):
                    report.freed_bytes += _nbytes(param.grad)
                param.grad = None
        if report.tensors == 0:
            report.skipped = "already offloaded"
        return report

    def _load_model(self, chunks: list[torch.nn.Module]) -> OffloadReport:
        report = OffloadReport()
        buffers, loose = model_tensors(chunks)
        for buffer in buffers:
            if buffer in self._homes:
                buffer.param_data.untyped_storage().resize_(self._sizes.pop(buffer))
                buffer.param_data.copy_(self._host[buffer], non_blocking=True)
                report.moved_bytes += _nbytes(buffer.param_data)
                report.tensors += 1
                # The host copy stays allocated for the next offload.
                del self._homes[buffer]
            if getattr(buffer, "grad_data_size", 0):
                # megatron's reload: storage re-allocated and zeroed.
                report.freed_bytes += buffer.grad_data_size * buffer.grad_data.element_size()
                buffer.reload_from_cpu(move_params=False, move_grads=True)
                report.tensors += 1
        for param in loose:
            if param in self._homes:
                param.data = param.data.to(self._homes.pop(param), copy=True, non_blocking=True)
                report.moved_bytes += _nbytes(param.data)
                report.tensors += 1
        if report.tensors == 0:
            report.skipped = "nothing was offloaded"
        return report

    # --------------------------------------------------------------- optimizer

    def offload_optimizer(self, optimizer) -> OffloadReport:
        """Copy optimizer state (Adam moments) and fp32 master weights to host memory; a no-op on CPU."""
        tensors = [c[k] for c, k in optimizer_tensors(optimizer)] + list(_master_params(optimizer))
        skipped = _no_cuda(tensors, "offload_optimizer")
        return skipped or self._offload_optimizer(optimizer, torch.device("cpu"))

    def load_optimizer(self, optimizer) -> OffloadReport:
        """Bring back what :meth:`offload_optimizer` moved."""
        report = self._load_optimizer(optimizer)
        if report.tensors == 0:
            return _no_cuda([c[k] for c, k in optimizer_tensors(optimizer)], "load_optimizer") or report
        return report

    def _offload_optimizer(self, optimizer, host: torch.device) -> OffloadReport:
        if optimizer in self._homes:
            return OffloadReport(skipped="already offloaded")
        report = OffloadReport()
        slots = optimizer_tensors(optimizer)
        masters = list(_master_params(optimizer))
        home = next((c[k].device for c, k in slots), None) or next((m.device for m in masters), None)
        # Host copies kept from the previous offload, reused in the same order.
        previous = self._host.get(optimizer, [])
        copies: list[torch.Tensor] = []
        for container, key in slots:
            reuse = previous[len(copies)] if len(copies) < len(previous) else None
            container[key] = _to_host(container[key], host, reuse)
            copies.append(container[key])
            report.moved_bytes += _nbytes(container[key])
        for master in masters:
            reuse = previous[len(copies)] if len(copies) < len(previous) else None
            master.data = _to_host(master.data, host, reuse)
            copies.append(master.data)
            report.moved_bytes += _nbytes(master.data)
        report.tensors = len(slots) + len(masters)
        if report.tensors == 0:
            # Before the first step there is no state yet; nothing to bring back either.
            return OffloadReport(skipped="optimizer has no state yet")
        self._host[optimizer] = copies
        self._homes[optimizer] = home
        return report

    def _load_optimizer(self, optimizer) -> OffloadReport:
        if optimizer not in self._homes:
            return OffloadReport(skipped="nothing was offloaded")
        home = self._homes.pop(optimizer)
        report = OffloadReport()
        slots = optimizer_tensors(optimizer)
        masters = list(_master_params(optimizer))
        for container, key in slots:
            container[key] = container[key].to(home, copy=True, non_blocking=True)
            report.moved_bytes += _nbytes(container[key])
        for master in masters:
            master.data = master.data.to(home, copy=True, non_blocking=True)
            report.moved_bytes += _nbytes(master.data)
        report.tensors = len(slots) + len(masters)
        return report


# ------------------------------------------------------------------ GPU memory


def empty_device_cache() -> None:
    """Return cached, unused GPU blocks to the driver (for the rollout engine); nothing on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_memory_gb() -> dict[str, float]:
    """Allocated and reserved GPU memory of this process in GiB (zeros without CUDA), for logs."""
    if not torch.cuda.is_available():
        return {"allocated_gb": 0.0, "reserved_gb": 0.0}
    return {
        "allocated_gb": torch.cuda.memory_allocated() / 2**30,
        "reserved_gb": torch.cuda.memory_reserved() / 2**30,
    }
