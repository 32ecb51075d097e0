"""Compiled CPU kernels for a decoding step (``csrc/decode_kernels.cpp``), float32.

Why: at decoding sizes the torch ops around the matmuls cost more than their arithmetic.

- Attention for one new token is, per row and key/value group, a [P, D] x [D, L] product, a
  softmax and a [P, L] x [L, D] product. Through ``torch.matmul`` that is two batched GEMMs of
  128 tiny matrices each (B=64, G=2) whose per-matrix overhead, not the arithmetic or the
  reading of the cache, sets the time: 1.1-1.3 ms per layer and step at L=150 with the cache out
  of the CPU's caches, as in a real step. ``decode_attention`` reads each group's keys and values
  once: 0.47 ms. ``decode_step_attention`` also applies a lean layer's rotary embedding and
  writes the new key and value into the cache in the same pass.
- Sampling from the full softmax (no top-k / top-p): ``sample_softmax`` draws by the same
  two-level inverse CDF as sampling.py in one pass for the maximum and one for the exponentials.

Whole generate calls at the benchmark size (batch 64, 128 tokens, interleaved pairs on the
2-core CI machine): attention 3.58 vs 3.79 s median, and with rotary and cache write 3.70 vs
3.78 s (a noisier hour).

The kernels are built once per machine by torch's JIT extension loader (a C++ compiler and
ninja, about 25 s; cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). They are compiled for this CPU (``-march=native``), so the
build's name carries a hash of the CPU's model and flags: a home directory shared by different
machines gets one build per CPU kind. Where they cannot be built, or with
``VERL_MEGATRON_CPU_KERNELS=0``, decoding keeps the torch ops, with one warning saying why. The
two agree to float32 rounding (tests/test_cpu_kernels.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["DISABLE_ENV", "decode_kernels"]

DISABLE_ENV = "VERL_MEGATRON_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("csrc") / "decode_kernels.cpp"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def _cpu_tag() -> str:
    """Short hash of this CPU's model and instruction-set flags (the build uses -march=native)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        text += platform.processor()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the pip package's binary is not on it when the venv's python
    # is called without activating the venv.
    with contextlib.suppress(ImportError):
        import ninja

        path = os.environ.get("PATH", "")
        if ninja.BIN_DIR not in path.split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path

    module = load(
        name=f"verl_megatron_decode_kernels_{_cpu_tag()}",
        sources=[str(_SOURCE)],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    return module


def decode_kernels() -> ModuleType | None:
    """The compiled kernels (float32, CPU; see csrc/decode_kernels.cpp for the exact contracts),
    or None where they are switched off or cannot be built (warned once):

    - ``decode_attention(q [B, G, P, D], k, v [B, G, >= L, D], mask [B, L], scale)`` -> [B, G, P, D];
    - ``decode_step_attention(qkv [B, G, P + 2, D], cos, signed_sin [B, R], k_cache, v_cache
      [B, G, T, D], start, mask [B, start + 1], scale)`` -> [B, G, P, D]: a lean layer's rotary
      embedding, cache write and attention in one pass;
    - ``sample_softmax(scaled_logits [B, V], uniforms [B], block)`` -> (tokens [B], log-probs [B]).

    The first call in a process loads, and on a new machine compiles, them.
    """
    with _lock:
        if "kernels" not in _loaded:
            _loaded["kernels"] = _load()
        return _loaded["kernels"]


def _load() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if not torch.backends.openmp.is_available():
        # The kernels split their work with torch's OpenMP threads; a torch without them would
        # run them on one thread, slower than the torch ops.
        warnings.warn("CPU decoding kernels not used: this torch is built without OpenMP", stacklevel=3)
        return None
    try:
        return _build()
    except Exception as exc:  # no compiler / ninja / writable cache: the torch ops still work
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(
            f"CPU decoding kernels not built ({type(exc).__name__}: {first}); decoding uses the "
            f"torch ops (set {DISABLE_ENV}=0 to skip the attempt)",
            stacklevel=3,
        )
        return None
