"""Linear layers with pre-packed weights for decoding on CPU (float32): oneDNN's blocked layout,
or 16-column panels for products of at most ``PANEL_MAX_ROWS`` rows (below).

A decoding step multiplies a few dozen rows (one per sequence) by every weight matrix. At those
sizes the plain ``torch.matmul`` path re-lays-out the weight for every call and reaches about
half of the machine's matmul rate; a weight packed once into oneDNN's blocked layout does not
(measured on the 2-core CI machine, 64 rows, float32: the [512 -> 32000] LM head 115 vs 65
GFLOP/s, a [512 -> 2752] MLP projection 115 vs 75). The decoder's weights do not change during
one generate call, so :func:`packed_linears` packs each weight once on first use (about 50 ms for
a 16M-parameter LM head) into a :class:`PackedWeights` store.

Only the matrix multiply changes: the layer's own ``forward`` still does its tensor-parallel
communication, bias handling and output gathering, and LoRA's forward hooks still run, because
the swap is of megatron's per-layer ``_forward_impl`` (the function it calls for the matmul).
Linears whose matmul route runs the batch-invariant kernels of bitwise parity
(``models/matmul_route.py``) keep them, so parity is untouched. The packed product differs from ``torch.matmul``
only by float32 rounding (a different summation order).

Across calls: weights change only when the trainer updates them, while a run makes many generate
calls per update (validation, several calls of n samples, multi-turn and agent turns). A
:class:`PackedWeights` store keeps its copies from one call to the next only when both calls name
the same weights version, an int the caller passes in (the trainer counts its actor updates); a
call naming another version, or none, starts from an empty store. Re-packing every call cost about
0.5 s of CPU per call at Qwen2.5-0.5B's shape (13% of a 16-row, 32-token generate call).

Decoding-size products (at most ``PANEL_MAX_ROWS`` rows) go instead through the compiled
``panel_linear`` kernel (csrc/panel_linear.cpp) with the weight stored in 16-column panels, where
the kernels build with its streaming AVX-512 tile. A decoding step reads every weight once, so it
is bound by memory bandwidth: oneDNN's product reads the weights at about 70% of it, the panels
at about 95%. Measured on the 2-core CI machine (Intel Xeon, AVX-512, 2 threads, other jobs
running) over every linear of the Qwen2.5-0.5B shape (1.98 GB, far past the 300 MiB L3), per
decoding step: 16 rows 86 vs 113-117 ms (oneDNN), 8 rows 76 vs 92 ms, 32 rows 137 vs 162 ms; at
64 rows the two tie (239 vs 235 ms). At 1 thread, with the two-panel tile past 16 rows (interleaved,
best of 5): 8 rows 163 vs 182 ms, 16 rows 188 vs 238, 32 rows 267 vs 301, 64 rows 473 vs 474.
(The tile is now 8 rows x 3 panels at every row count; its numbers are in csrc/panel_linear.cpp.)
Up to 64 rows the panels are used all the same: a prefill of
up to 64 rows (GRPO's few prompts) then needs no oneDNN copy, and the first call after an update
repacks one layout instead of two (in place, 0.44 s for the 1.98 GB at 1 thread, against 0.69 s
for oneDNN's copy of the layers alone). Summing 1.98 GB takes
82 ms (24 GB/s): that is the floor. Whole generate calls at that shape (prompts of 32, 32 new
tokens, warm store, best of 3 interleaved, loaded): 16 rows 4.10 vs 5.00 s, 8 rows 3.47 vs 3.90 s.
New panel buffers are advised onto 2 MiB pages (utils/cpu_heap.empty_on_huge_pages): sweeping
every panel of that shape once, interleaved with the same panels on 4 KiB pages (AMD EPYC, 2
threads), 16 rows 81.8 vs 88.8 ms, 8 rows 46.8 vs 53.4 ms (best of 6).

Memory: the packed copies double the weights' memory for the duration of the call, and with a
kept store (``rollout.keep_packed_weights``) from the call until a call with another version,
the training update in between included. A call whose prefill has more than ``PANEL_MAX_ROWS``
rows and whose decoding has at most that many (a batch of up to 64 sequences) packs both
layouts: the weights' memory three times over.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

from verl_megatron.utils.cpu_heap import empty_on_huge_pages

__all__ = [
    "PANEL_MAX_ROWS",
    "PackedMatmul",
    "PackedWeights",
    "batch_invariant_route",
    "pack_weight",
    "packed_linears",
    "packing_available",
]

# Rows the packed layout is tuned for: a decoding batch. The layout barely depends on it
# (16..4096 rows measured within 10% of each other at 8, 64 and 512 rows).
_ROWS_HINT = 64

# Products with at most this many rows use the panel kernel where it streams (see above).
PANEL_MAX_ROWS = 64
_EPILOGUES = {"none": 0, "swish": 1, "mul": 2, "add": 3}  # csrc/panel_linear.cpp's codes


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


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` [N, K] as panels [ceil(N / 16), K, 16] (the last zero-padded) for ``panel_linear``:
    panel p is columns 16p..16p+15 of ``weight.T``, contiguous. Written into ``out`` when given
    (a buffer of that shape: repacking into the last version's buffer saves its page faults,
    about as much as the copy itself)."""
    n, k = weight.shape
    full, tail = divmod(n, 16)
    if out is None:
        # Huge pages: a decoding step streams every panel once (cpu_heap.empty_on_huge_pages).
        out = empty_on_huge_pages((full + (tail > 0), k, 16), weight.dtype)
    out[:full].copy_(weight[: full * 16].view(full, 16, k).transpose(1, 2))
    if tail:
        out[full].zero_()[:, :tail].copy_(weight[full * 16 :].t())
    return out


@functools.cache
def _panel_kernels():
    """The compiled kernels when their panel product streams (an AVX-512 build), else None."""
    from verl_megatron.rollout.cpu.kernels import decode_kernels

    kernels = decode_kernels()
    return kernels if kernels is not None and kernels.panel_linear_streams() else None


class PackedWeights:
    """Packed copies of weights, valid for one weights version (see the module docstring).

    ``for_call(version)`` brackets one generate call: it yields the store, emptied first unless
    ``version`` is an int equal to the previous call's, and emptied after unless ``keep`` and
    ``version`` is an int. So a copy is only ever used within calls that name the version it was
    packed at; a caller that cannot name one (None) gets fresh copies every call.

    Args:
        keep: keep the copies between calls of one version (``rollout.keep_packed_weights``).
        panels: multiply up to ``PANEL_MAX_ROWS`` rows with the panel kernel where it streams
            (False: oneDNN for every product).
    """

    def __init__(self, keep: bool = True, panels: bool = True) -> None:
        self.keep = keep
        self.panels = panels
        self.packs = 0  # weights packed so far (each miss, either layout), for tests and benchmarks
        self._version: int | None = None
        # (id of the weight, rows, panels?) -> (the weight itself, its packed rows); holding the
        # weight keeps its id from being reused by another tensor while the entry exists.
        self._entries: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # The last version's panel buffers under the same keys, written over in place when the
        # new version packs the same weight (oneDNN's reorder has no in-place form).
        self._spare: dict[tuple, torch.Tensor] = {}

    @contextlib.contextmanager
    def for_call(self, version: int | None) -> Iterator[PackedWeights]:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"weights_version must be an int or None, got {version!r}")
        if version is None or version != self._version:
            self._spare = {key: packed for key, (_, packed) in self._entries.items() if key[-1]}
            self._entries.clear()
        self._version = version
        try:
            yield self
        finally:
            self._spare.clear()
            if not (self.keep and version is not None):
                self._entries.clear()
                self._version = None

    def get(self, weight: torch.Tensor, rows: slice | None = None, panels: bool = False) -> torch.Tensor:
        """``weight[rows]`` ([out, in], float32, CPU) packed for oneDNN (or in panels), from the
        store or packed now."""
        key = (id(weight), None if rows is None else (rows.start, rows.stop, rows.step), panels)
        entry = self._entries.get(key)
        if entry is None or entry[0] is not weight:
            source = (weight.detach() if rows is None else weight.detach()[rows]).contiguous()
            if panels:
                spare = self._spare.pop(key, None)
                fits = spare is not None and spare.shape == (-(-source.shape[0] // 16), source.shape[1], 16)
                entry = (weight, pack_panels(source, spare if fits else None))
            else:
                entry = (weight, pack_weight(source))
            self._entries[key] = entry
            self.packs += 1
        return entry[1]

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: slice | None = None,
        epilogue: str = "none",
        other: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` [M, K] @ ``weight[rows]``.T + ``bias``, then ``epilogue``: none, swish (SiLU), mul
        (times ``other`` [M, N]) or add (plus ``other``). Float32 CPU tensors, no autograd."""
        kernels = _panel_kernels() if self.panels and x.shape[0] <= PANEL_MAX_ROWS else None
        if kernels is not None:
            n = weight.shape[0] if rows is None else len(range(*rows.indices(weight.shape[0])))
            return kernels.panel_linear(
                x.contiguous(), self.get(weight, rows, panels=True), n, bias, _EPILOGUES[epilogue],
                None if other is None else other.contiguous(),
            )  # fmt: skip
        packed = self.get(weight, rows)
        if other is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, epilogue, [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, epilogue)


class PackedMatmul:
    """Stands in for megatron's ``_forward_impl`` (same arguments) in forward-only use."""

    def __init__(self, original, store: PackedWeights) -> None:
        self.original = original
        self.store = store

    def __call__(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args, **kwargs):
        if (
            torch.is_grad_enabled()
            or kwargs.get("sequence_parallel")
            or input.dtype != torch.float32
            or weight.dtype != torch.float32
            or input.device.type != "cpu"
        ):
            return self.original(input, weight, bias, *args, **kwargs)
        out = self.store.linear(input.reshape(-1, input.shape[-1]), weight, bias)
        return out.view(*input.shape[:-1], out.shape[-1])


def batch_invariant_route(module: torch.nn.Module) -> bool:
    """Whether ``module`` multiplies through a matmul route with bitwise parity's kernels on
    (``models/matmul_route.MatmulRoute.use_batch_invariant_kernels``): its product is not replaced."""
    return bool(getattr(getattr(module, "route", None), "batch_invariant", False))


def _on_cpu(module: torch.nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in module.parameters(recurse=False))


@contextlib.contextmanager
def packed_linears(chunks: Sequence[torch.nn.Module], store: PackedWeights | None = None) -> Iterator[int]:
    """Within the context, megatron's column/row parallel linears of ``chunks`` multiply with
    packed weights from ``store`` (None: a store of this context's own) when they run on CPU in
    float32 without autograd; yields how many layers were switched (0 where packing is
    unavailable). The weights must not change inside."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    store = PackedWeights(keep=False) if store is None else store
    switched: list[torch.nn.Module] = []
    if packing_available():
        for chunk in chunks:
            for module in chunk.modules():
                if (
                    isinstance(module, (ColumnParallelLinear, RowParallelLinear))
                    and not batch_invariant_route(module)  # parity's kernels stay
                    and not getattr(module, "explicit_expert_comm", False)
                    and _on_cpu(module)
                ):
                    module._forward_impl = PackedMatmul(module._forward_impl, store)
                    switched.append(module)
    try:
        yield len(switched)
    finally:
        for module in switched:
            del module._forward_impl
