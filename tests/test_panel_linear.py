"""The decoding-size linear kernel (csrc/panel_linear.cpp) and how the packed store uses it.

Two kinds of check, each on the native build and the generic (x86-64-v2) one:
- integer-valued inputs, whose every partial sum is exact in float32: the kernel must equal the
  float64 result bit for bit (this pins the indexing: rows, panels, the padded last panel, the
  bias, the epilogues);
- random inputs against float64 within the rounding bound of the kernel's own summation order
  (a chain of at most 256 fused multiply-adds per chunk, then the chunks added in order):
  |error| <= gamma(n) * sum |x * w| with n = 256 + chunks + 2, gamma(n) = n u / (1 - n u),
  u = 2^-24. The bound holds for any evaluation in that order on any CPU; a wrong row, column or
  k term is off by a share of the sum itself, thousands of times more.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import advised_huge_pages
from verl_megatron.rollout.cpu import kernels as cpu_kernels
from verl_megatron.rollout.cpu import packed_linear

CHUNK = 256  # csrc/panel_linear.cpp's kChunk
U = 2.0**-24
EPILOGUES = {"none": 0, "swish": 1, "mul": 2, "add": 3}


@pytest.fixture(scope="module", params=cpu_kernels.ARCHES)
def kernels(request):
    module = cpu_kernels.decode_kernels(request.param)
    assert module is not None, f"the {request.param} CPU kernels did not build on this machine"
    return module


def _float64(x, w, bias, epilogue, other):
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    if epilogue == "swish":
        out = out * torch.sigmoid(out)
    elif epilogue == "mul":
        out = other.double() * out
    elif epilogue == "add":
        out = other.double() + out
    return out


def _run(kernels, x, w, bias, epilogue, other):
    panels = packed_linear.pack_panels(w)
    return kernels.panel_linear(x, panels, w.shape[0], bias, EPILOGUES[epilogue], other)


def _where(diff: torch.Tensor) -> str:
    row, col = divmod(int(diff.argmax()), diff.shape[1])
    return f"max diff {float(diff.max()):.3e} at row {row}, column {col}"


# (M, N, K): tiles of 8 rows x 3 panels (a stretch's last 1 or 2 panels in a narrower one): row
# counts around whole tiles (7, 8, 9, 16, 17, 32 rows) and partial ones, panel counts that leave
# 0, 1 and 2 over, and a zero-padded last panel.
SHAPES = [
    (1, 1, 1), (5, 37, 7), (7, 48, 40), (8, 48, 300), (9, 64, 300), (12, 100, 513), (16, 16, 300),
    (16, 80, 600), (17, 64, 600), (20, 37, 300), (32, 96, 257), (33, 21, 513), (64, 48, 96),
]  # fmt: skip


@pytest.mark.parametrize("epilogue", ["none", "mul", "add"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_integer_inputs_give_the_exact_result(kernels, m, n, k, epilogue):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randint(-4, 5, (m, k), generator=g).float()
    w = torch.randint(-4, 5, (n, k), generator=g).float()
    bias = torch.randint(-50, 51, (n,), generator=g).float()
    other = None if epilogue == "none" else torch.randint(-3, 4, (m, n), generator=g).float()
    out = _run(kernels, x, w, bias, epilogue, other)
    diff = (out.double() - _float64(x, w, bias, epilogue, other)).abs()
    assert out.shape == (m, n) and float(diff.max()) == 0.0, _where(diff)


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("m, n, k", SHAPES[1:])
def test_random_inputs_within_the_rounding_bound_of_its_order(kernels, m, n, k, epilogue):
    g = torch.Generator().manual_seed(7 * m + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g)
    other = torch.randn(m, n, generator=g) if epilogue in ("mul", "add") else None
    out = _run(kernels, x, w, bias, epilogue, other).double()
    exact = _float64(x, w, bias, epilogue, other)
    steps = CHUNK + math.ceil(k / CHUNK) + 2
    gamma = steps * U / (1 - steps * U)
    # Rounding of x @ w.T + b in this order; the epilogue scales it by at most |other| (mul) or
    # 1.1 (SiLU's slope) and rounds its own result (a few ulps for swish's exp and division).
    bound = gamma * ((x.double().abs() @ w.double().abs().t()) + bias.double().abs())
    if epilogue == "mul":
        bound = bound * other.double().abs()
    elif epilogue == "swish":
        bound = bound * 1.1
    bound = bound + 8 * U * exact.abs() + 1e-30
    ratio = (out - exact).abs() / bound
    assert float(ratio.max()) <= 1.0, f"{epilogue}: error / bound {float(ratio.max()):.3f}; {_where(ratio)}"
    # and the bound is tight enough to mean something: far below the result's own size
    assert float((bound / (exact.abs() + 1)).max()) < 1e-3


@pytest.mark.parametrize("m", [5, 16])
def test_the_split_across_threads_changes_no_number(kernels, m):
    """Each thread tiles its own stretch of panels (3 at a time, the rest narrower): at 1, 2 and 3
    threads the product is the same, bit for bit, and exact on integer inputs."""
    g = torch.Generator().manual_seed(m)
    x = torch.randint(-4, 5, (m, 700), generator=g).float()
    w = torch.randint(-4, 5, (16 * 7 + 5, 700), generator=g).float()  # 8 panels, the last padded
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_run(kernels, x, w, None, "none", None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert torch.equal(outs[0].double(), _float64(x, w, None, "none", None))


def test_streaming_tile_is_the_avx512_build_and_bad_input_is_refused(kernels):
    flags = Path("/proc/cpuinfo").read_text()
    native_avx512 = " avx512f" in flags
    expected = native_avx512 and kernels is cpu_kernels.decode_kernels("native")
    assert kernels.panel_linear_streams() is expected
    x, w = torch.ones(2, 8), torch.ones(5, 8)
    panels = packed_linear.pack_panels(w)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernels.panel_linear(x, panels, 17, None, 0, None)  # 17 columns need 2 panels
    with pytest.raises(RuntimeError, match="`other` goes with"):
        kernels.panel_linear(x, panels, 5, None, 2, None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.panel_linear(x.double(), panels, 5, None, 0, None)
    with pytest.raises(RuntimeError, match="K must be at least 1"):  # no k step: sums never written
        kernels.panel_linear(
            torch.ones(2, 0), packed_linear.pack_panels(torch.ones(5, 0)), 5, torch.ones(5), 0, None
        )


def test_the_store_multiplies_few_rows_in_panels_and_many_with_onednn():
    """``PackedWeights.linear``: up to PANEL_MAX_ROWS rows through the panels where they stream,
    more rows (or ``panels=False``) through oneDNN; both within float32 rounding of float64, and
    each layout packed once per weight."""
    assert packed_linear.packing_available(), "oneDNN packed linear unavailable in this torch build"
    streams = packed_linear._panel_kernels() is not None
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    store, onednn_only = packed_linear.PackedWeights(), packed_linear.PackedWeights(panels=False)
    for rows, store_packs in [(packed_linear.PANEL_MAX_ROWS, 1), (packed_linear.PANEL_MAX_ROWS + 1, 2)]:
        x = torch.randn(rows, 64, generator=g)
        exact = x.double() @ w.double().t() + bias.double()
        # float32 rounding of a 64-term dot product plus the bias, in any summation order
        steps = 64 + 1
        bound = steps * U / (1 - steps * U) * (x.double().abs() @ w.double().abs().t() + bias.double().abs())
        for s in (store, onednn_only):
            for _ in range(2):  # the second call reuses the packed copy
                out = s.linear(x, w, bias)
            ratio = (out.double() - exact).abs() / bound
            assert float(ratio.max()) <= 1.0, f"error / bound {float(ratio.max()):.3f}; {_where(ratio)}"
        if streams:
            assert store.packs == store_packs  # the panels first, then oneDNN's layout
    assert onednn_only.packs == 1
    if streams:
        panel_key = next(key for key in store._entries if key[-1])
        assert store._entries[panel_key][1].shape == (3, 64, 16)  # 40 columns in 3 panels


def test_row_slices_with_a_step_are_kept_apart():
    """The store's key names a slice's step: rows 0, 2, 4, ... are not served rows 0, 1, 2, ...
    (nor the reverse), in either layout."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(40, 32, generator=g), torch.randn(3, 32, generator=g)
    for panels in (True, False):
        store = packed_linear.PackedWeights(panels=panels)
        for rows in (slice(0, 20), slice(0, 20, 2), slice(0, 20)):
            exact = x.double() @ w[rows].double().t()
            bound = 33 * U / (1 - 33 * U) * (x.double().abs() @ w[rows].double().abs().t())
            out = store.linear(x, w, None, rows)
            assert out.shape == exact.shape, f"{rows}: shape {tuple(out.shape)}"
            ratio = (out.double() - exact).abs() / bound
            assert float(ratio.max()) <= 1.0, (
                f"{rows}: error / bound {float(ratio.max()):.3f}; {_where(ratio)}"
            )
        assert store.packs == 2  # the plain slice once, the stepped one once


def test_a_new_version_repacks_the_panels_in_place():
    """A call at a new weights version writes the panels over the last version's buffers (no new
    allocation); the product then follows the new weights exactly as a fresh store's does."""
    if packed_linear._panel_kernels() is None:
        # Without the streaming build the store never packs panels; the layout itself:
        w = torch.randn(37, 5)
        out = torch.full((3, 5, 16), 7.0)
        assert torch.equal(packed_linear.pack_panels(w, out), packed_linear.pack_panels(w))
        return
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(37, 64, generator=g), torch.randn(4, 64, generator=g)
    store = packed_linear.PackedWeights()

    def call(version):
        with store.for_call(version):
            out = store.linear(x, w, None)
            buffer = next(packed for key, (_, packed) in store._entries.items() if key[-1])
        return out, buffer.data_ptr()

    first, where = call(0)
    with torch.no_grad():
        w.mul_(-0.5)
    second, where_again = call(1)
    with packed_linear.PackedWeights().for_call(None) as fresh:
        expected = fresh.linear(x, w, None)
    assert where_again == where and store.packs == 2
    assert torch.equal(second, expected), f"max diff {float((second - expected).abs().max()):.3e}"
    assert torch.allclose(second, first * -0.5, atol=1e-5)


def test_new_panels_are_allocated_on_huge_pages():
    # A decoding step streams every panel once; huge pages spare that sweep a TLB miss every 4 KiB.
    panels = packed_linear.pack_panels(torch.randn(1000, 896))
    assert panels.shape == (63, 896, 16)
    assert advised_huge_pages(panels.data_ptr()), "the panels' memory has no huge-page advice"
