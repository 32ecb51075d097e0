"""The compiled one-token decode attention (rollout/cpu/kernels.py) against float64.

Its error to a float64 reference must stay within twice the Python path's own float32 error
on the same inputs (the decoder's fallback: rotary embedding, cache write, matmul, softmax,
matmul). Why 2: both are float32 evaluations of the same sums in different orders (the kernel's
order depends on the vector width it was compiled for), so both obey one rounding bound of which
each measured error is one sample; a real defect (a leaked mask, a wrong scale) is off by orders
of magnitude. Masked columns hold huge values, so a masked key that leaked into a softmax would
show as a large error. Every check runs on the native build and on the generic (x86-64-v2) one.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import pytest
import torch

from verl_megatron.rollout.cpu import kernels as cpu_kernels


def _matmul_path(q, k, v, mask, scale):
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).add_(mask[:, None, None, :])
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _inputs(batch, groups, per_group, dim, length, total, seed=0, whole=False):
    """q [B, G, P, D]; caches [B, G, total, D] of which the first ``length`` columns are used;
    an additive mask [B, length] with left padding (row b hides its first b % 5 columns, whose
    keys and values are set huge). ``whole``: the whole caches instead."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, groups, per_group, dim, generator=g)
    k = torch.randn(batch, groups, total, dim, generator=g)
    v = torch.randn(batch, groups, total, dim, generator=g)
    mask = torch.zeros(batch, length)
    for b in range(batch):
        hidden = min(b % 5, length - 1)
        mask[b, :hidden] = float("-inf")
        k[b, :, :hidden] = 1e4
        v[b, :, :hidden] = 1e6
    if whole:
        return q, k, v, mask
    return q, k[:, :, :length], v[:, :, :length], mask


@pytest.fixture(scope="module", params=cpu_kernels.ARCHES)
def kernels(request):
    module = cpu_kernels.decode_kernels(request.param)
    assert module is not None, (
        f"the {request.param} CPU decoding kernels did not build on this machine (see the warning "
        "above: they need a C++ compiler and ninja)"
    )
    return module


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.decode_attention


@pytest.mark.parametrize(
    "groups, per_group, dim, length, total",
    [(2, 4, 64, 150, 192), (2, 4, 128, 37, 40), (2, 2, 16, 13, 13), (3, 3, 40, 1, 8), (1, 8, 32, 300, 301)],
    ids=["P4-D64", "P4-D128", "P2-D16", "one-key", "P8-D32-long"],
)
def test_kernel_matches_float64_within_the_matmul_paths_error(kernel, groups, per_group, dim, length, total):
    q, k, v, mask = _inputs(11, groups, per_group, dim, length, total)
    scale = dim**-0.5
    ours = kernel(q, k, v, mask, scale)
    theirs = _matmul_path(q, k, v, mask, scale)
    exact = _matmul_path(q.double(), k.double(), v.double(), mask.double(), scale)
    floor = float((theirs - exact).abs().max())
    gap = (ours - exact).abs()
    where = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
    assert float(gap.max()) <= 2 * floor, (
        f"kernel vs float64: max diff {float(gap.max()):.3g} at (b, g, p, d) {where}; "
        f"matmul path vs float64 {floor:.3g}"
    )


def test_kernel_uses_the_threads_and_rejects_bad_input(kernel):
    q, k, v, mask = _inputs(8, 2, 4, 64, 20, 24)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = kernel(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    # Each (row, group) is computed whole by one thread: the split changes no number.
    assert torch.equal(one, two)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(q.double(), k, v, mask, 0.125)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        kernel(q, k[:, :, :5], v, mask, 0.125)
    with pytest.raises(RuntimeError, match="unit stride"):
        kernel(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, mask, 0.125)


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader with its per-process results forgotten (restored afterwards), default target."""
    saved = dict(cpu_kernels._loaded)
    cpu_kernels._loaded.clear()
    monkeypatch.delenv(cpu_kernels.ARCH_ENV, raising=False)  # the default target
    yield
    cpu_kernels._loaded.clear()
    cpu_kernels._loaded.update(saved)


@pytest.mark.parametrize("value", ["0", "off"])
def test_switched_off_by_the_environment(fresh_loader, monkeypatch, value):
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, value)
    monkeypatch.setattr(cpu_kernels, "_build", lambda arch: pytest.fail("built although switched off"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_kernels.decode_kernels() is None


def test_a_failed_build_warns_once_and_falls_back(fresh_loader, monkeypatch):
    calls = []

    def broken(arch):
        calls.append(arch)
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_build", broken)
    with pytest.warns(UserWarning) as record:
        assert cpu_kernels.decode_kernels() is None
        assert cpu_kernels.decode_kernels() is None
    assert calls == ["native"] and len(record) == 1
    message = str(record[0].message)
    assert "\n" not in message
    assert "RuntimeError: Ninja is required to load C++ extensions" in message
    assert cpu_kernels.DISABLE_ENV in message


def test_the_target_comes_from_the_argument_then_the_environment(fresh_loader, monkeypatch):
    built = []
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_build", lambda arch: built.append(arch) or arch)
    monkeypatch.setenv(cpu_kernels.ARCH_ENV, "Generic ")
    assert cpu_kernels.decode_kernels() == "generic"
    assert cpu_kernels.decode_kernels("native") == "native"
    assert cpu_kernels.decode_kernels() == "generic"
    assert built == ["generic", "native"]  # one load per target and process
    monkeypatch.setenv(cpu_kernels.ARCH_ENV, "avx9")
    with pytest.raises(ValueError, match=f"{cpu_kernels.ARCH_ENV}='avx9': expected one of native, generic"):
        cpu_kernels.decode_kernels()


def test_flags_of_each_target(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    assert "-march=native" in cpu_kernels._flags("native")
    generic = cpu_kernels._flags("generic")
    assert "-march=x86-64-v2" in generic and not any("native" in f for f in generic)
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert not any(f.startswith("-march") for f in cpu_kernels._flags("generic"))


def test_the_sources_parse_only_the_torch_headers_they_use(monkeypatch):
    """A fresh machine compiles the kernels for both targets. torch/extension.h parses the
    whole C++ frontend (nn, optim, data): 32 s of compiler CPU for an empty file at -O3, against
    14 s for torch/types.h and 12 s for the pybind11 glue. The build is one translation unit
    (decode_kernels.cpp includes panel_linear.cpp), so those headers are parsed once per target:
    a cold native build took 31 CPU s, against about 40 s as two units."""
    texts = {source.name: source.read_text() for source in cpu_kernels._SOURCES}
    assert not [name for name, text in texts.items() if "<torch/extension.h>" in text]
    binders = [name for name, text in texts.items() if "PYBIND11_MODULE" in text]
    glue = [name for name, text in texts.items() if "<torch/csrc/utils/pybind.h>" in text]
    assert binders == glue == ["decode_kernels.cpp"], (binders, glue)
    assert '#include "panel_linear.cpp"' in texts["decode_kernels.cpp"]
    # What the loader is given: the one unit, under the name that hashes both files.
    calls = []
    monkeypatch.setenv("PATH", os.environ["PATH"])  # _build may add ninja's folder: undone after
    monkeypatch.setattr(cpu_kernels, "_build_flock", lambda name: contextlib.nullcontext())
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kwargs: calls.append(kwargs))
    cpu_kernels._build("generic")
    assert [Path(s).name for s in calls[0]["sources"]] == ["decode_kernels.cpp"], calls


# Each input of the build's name, and a changed value for it: the name must change with each.
_KEY_INPUTS = {
    "_cpu_tag": lambda: "model name : Another CPU\nflags : fpu sse2",
    "_compiler": lambda: "/opt/clang/bin/clang++ clang version 18.1.0",
    "_source_hash": lambda: "0" * 64,
    "_flags": lambda arch: ["-O2"],
}


@pytest.mark.parametrize("name", [*_KEY_INPUTS, "torch", "machine"])
@pytest.mark.parametrize("arch", cpu_kernels.ARCHES)
def test_the_build_name_changes_with_everything_that_changes_the_binary(monkeypatch, name, arch):
    """A machine moved to another CPU model, a new compiler, an edited source, other flags or
    another torch get another build; the generic build does not depend on the CPU model (it
    runs on any x86-64-v2 CPU), only on the kind of machine."""
    before = cpu_kernels.build_name(arch)
    assert before.startswith(f"verl_megatron_decode_kernels_{arch}_")
    assert before == cpu_kernels.build_name(arch)  # deterministic
    if name == "torch":
        monkeypatch.setattr(cpu_kernels.torch, "__version__", "9.9.9")
    elif name == "machine":
        monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "riscv64")
    else:
        monkeypatch.setattr(cpu_kernels, name, _KEY_INPUTS[name])
    after = cpu_kernels.build_name(arch)
    if name == "_cpu_tag" and arch == "generic":
        assert after == before
    else:
        assert after != before, f"{name} changed but the {arch} build's name did not"
    assert cpu_kernels.build_name("native") != cpu_kernels.build_name("generic")


def test_the_cpu_tag_and_compiler_describe_this_machine():
    """The real inputs, not placeholders: the CPU's instruction-set flags and the compiler's
    resolved path and version line."""
    tag = cpu_kernels._cpu_tag()
    assert tag.startswith(cpu_kernels.platform.machine())
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    flags = [line for line in info if line.startswith(("flags", "Features"))]
    assert not flags or flags[0] in tag
    compiler = cpu_kernels._compiler()
    assert "not found" not in compiler and Path(compiler.split(" ", 1)[0]).is_file(), compiler


def _python_step(qkv, cos, signed_sin, k_cache, v_cache, start, mask, scale):
    """decode.py's path for one new token: rotary (fused form), cache write, matmul attention."""
    from verl_megatron.rollout.decode import _rotate_fused

    per_group = qkv.shape[2] - 2
    turned = _rotate_fused(qkv[:, :, : per_group + 1], cos[:, None, None, :], signed_sin[:, None, None, :])
    k_cache[:, :, start] = turned[:, :, per_group]
    v_cache[:, :, start] = qkv[:, :, per_group + 1]
    end = start + 1
    return _matmul_path(turned[:, :, :per_group], k_cache[:, :, :end], v_cache[:, :, :end], mask, scale)


@pytest.mark.parametrize(
    "groups, per_group, dim, rotated, start, total",
    [(2, 4, 64, 64, 120, 192), (2, 2, 16, 16, 0, 4), (1, 3, 40, 16, 30, 31)],
    ids=["P4-D64", "first-column", "partial-rotary"],
)
def test_fused_step_matches_float64_and_writes_the_cache(
    kernels, groups, per_group, dim, rotated, start, total
):
    """decode_step_attention turns the new query heads and key, writes key and value at column
    ``start`` (the rest of the cache untouched) and attends: context and cache within twice the
    Python path's float32 error of float64."""
    batch = 7
    _, k_cache, v_cache, mask = _inputs(batch, groups, per_group, dim, start + 1, total, seed=3, whole=True)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(batch, groups, per_group + 2, dim, generator=g)
    angle = torch.rand(batch, rotated, generator=g) * 6.3
    cos, signed_sin = angle.cos(), angle.sin()
    signed_sin[:, : rotated // 2] *= -1
    scale = dim**-0.5
    ours_k, ours_v = k_cache.clone(), v_cache.clone()
    ours = kernels.decode_step_attention(qkv, cos, signed_sin, ours_k, ours_v, start, mask, scale)
    theirs_k, theirs_v = k_cache.clone(), v_cache.clone()
    theirs = _python_step(qkv, cos, signed_sin, theirs_k, theirs_v, start, mask, scale)
    exact_k, exact_v = k_cache.double(), v_cache.double()
    exact = _python_step(
        qkv.double(), cos.double(), signed_sin.double(), exact_k, exact_v, start, mask.double(), scale
    )
    untouched = torch.ones(total, dtype=torch.bool)
    untouched[start] = False
    assert torch.equal(ours_k[:, :, untouched], k_cache[:, :, untouched])
    assert torch.equal(ours_v, theirs_v)  # the value is copied as it is
    for name, mine, python, reference in (
        ("context", ours, theirs, exact),
        ("cached key", ours_k[:, :, start], theirs_k[:, :, start], exact_k[:, :, start]),
    ):
        floor = float((python - reference).abs().max())
        gap = (mine - reference).abs()
        where = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
        assert float(gap.max()) <= 2 * max(floor, 1e-7), (
            f"{name}: kernel vs float64 max diff {float(gap.max()):.3g} at {where}; Python path vs float64 "
            f"{floor:.3g}"
        )


def test_sample_softmax_draws_the_python_paths_tokens(kernels):
    """For the same uniforms the compiled draw picks sampling.py's two-level inverse-CDF tokens
    (vocabulary 3000: blocks of 256 and a partial last one; masked -inf entries never), and its
    log-probabilities are within twice the Python path's float32 error of float64."""
    from verl_megatron.rollout import sampling

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(200, 3000, generator=g) * 3
    logits[:, 1000:1300] = float("-inf")
    u = torch.rand(200, generator=g)
    ours, our_log_probs = kernels.sample_softmax(logits, u, sampling._BLOCK)
    theirs = sampling._inverse_cdf_blocked(torch.softmax(logits, dim=-1), None, u)
    differ = torch.nonzero(ours != theirs).flatten().tolist()
    assert not differ, (
        f"tokens differ in rows {differ[:10]}: {ours[differ[:10]].tolist()} vs {theirs[differ[:10]].tolist()}"
    )
    assert not bool(((ours >= 1000) & (ours < 1300)).any())
    rows = torch.arange(200)
    python = torch.softmax(logits, dim=-1)[rows, ours].log()
    exact = torch.log_softmax(logits.double(), dim=-1)[rows, ours]
    floor = float((python - exact).abs().max())
    gap = (our_log_probs - exact).abs()
    assert float(gap.max()) <= 2 * max(floor, 1e-7), (
        f"log-probs: max diff {float(gap.max()):.3g} to float64 at row {int(gap.argmax())}; Python path {floor:.3g}"
    )


def test_a_lock_left_by_a_killed_build_is_removed_and_builds_are_serialized(tmp_path, monkeypatch):
    """torch's loader waits for ever on a ``lock`` file that a killed compile left behind; the
    build removes it under an OS lock that dies with its holder, and two builds never overlap."""
    import threading
    import time

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_kernels.build_name("generic")
    folder = tmp_path / name
    folder.mkdir()
    (folder / "lock").write_text("")  # what a compile killed mid-way leaves
    inside, overlaps = [], []

    def fake_load(name, **kwargs):
        assert not (folder / "lock").exists(), "torch's loader would wait on the stale lock"
        overlaps.append(len(inside))
        inside.append(name)
        time.sleep(0.2)
        inside.pop()
        return name

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    results = []
    with pytest.warns(UserWarning, match="left by a build that was killed"):
        threads = [
            threading.Thread(target=lambda: results.append(cpu_kernels._build("generic"))) for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == [name, name]
    assert overlaps == [0, 0], f"builds overlapped: {overlaps}"


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.RMSNorm's forward in float64: the reference both norm tests measure errors from."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.detach().double()


@pytest.mark.parametrize("rows, width", [(16, 896), (3, 5), (130, 64)], ids=["step", "narrow", "prefill"])
def test_rms_norm_matches_float64_within_torchs_error(kernels, rows, width):
    """The compiled rms_norm computes torch.nn.RMSNorm's forward: against float64 within twice
    torch's own float32 error on the same inputs (rows of very different sizes, one all zero);
    bad input is refused."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0] = 0.0
    norm = torch.nn.RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
        theirs = norm(x)
    weight = norm.weight.detach()
    ours = kernels.rms_norm(x, weight, 1e-6)
    exact = _rms_norm64(x, weight, 1e-6)
    floor = float((theirs.double() - exact).abs().max())
    gap = float((ours.double() - exact).abs().max())
    assert floor > 0 and gap <= 2 * floor, f"rms_norm vs float64 {gap:.3g}; torch vs float64 {floor:.3g}"
    assert torch.equal(ours[0], torch.zeros(width))
    with pytest.raises(RuntimeError, match="weight \\[H\\]"):
        kernels.rms_norm(x, weight[:-1], 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(x.double(), weight, 1e-6)


def test_lean_layers_norm_through_the_kernel_where_it_applies(kernels):
    """lean_layer._norm: an RMSNorm with a float32 weight runs the compiled kernel on any leading
    shape (its default eps is float32's, as torch's), within twice torch's error of float64; a
    LayerNorm, or no kernels, keeps the module."""
    from verl_megatron.rollout.cpu import lean_layer

    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 3, 40, generator=g)
    for eps in (1e-5, None):
        norm = torch.nn.RMSNorm(40, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(40, generator=g))
            theirs = norm(x)
        fn = lean_layer._norm(norm, kernels)
        assert fn is not norm
        ours = fn(x)
        e = torch.finfo(torch.float32).eps if eps is None else eps
        exact = _rms_norm64(x, norm.weight, e)
        floor = float((theirs.double() - exact).abs().max())
        assert ours.shape == x.shape and float((ours.double() - exact).abs().max()) <= 2 * floor
    layer_norm = torch.nn.LayerNorm(40)
    assert lean_layer._norm(layer_norm, kernels) is layer_norm
    assert lean_layer._norm(norm, None) is norm
