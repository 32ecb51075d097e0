"""Compiled CPU kernels for a decoding step (``csrc/decode_kernels.cpp``, ``csrc/panel_linear.cpp``), float32.

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
- Linears of at most 64 rows (a decoding step reads every weight once, so it is bound by memory):
  ``panel_linear`` streams each weight from 16-column panels (AVX-512 builds only; the numbers
  are in packed_linear.py).

Whole generate calls at the benchmark size (batch 64, 128 tokens, interleaved pairs on the
2-core CI machine): attention 3.58 vs 3.79 s median, and with rotary and cache write 3.70 vs
3.78 s (a noisier hour).

The kernels are built once per machine by torch's JIT extension loader (a C++ compiler and
ninja, about 25 s; cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``). ``VERL_MEGATRON_CPU_KERNELS_ARCH`` picks the target:
``native`` (default, ``-march=native``: this CPU's widest vectors) or ``generic``
(``-march=x86-64-v2`` on x86, SSE4.2 and no wider: runs on any x86 server of the last decade;
elsewhere no ``-march`` at all). The build's name is a hash of everything that changes the binary
(the target; for ``native`` the CPU's model and flags; the compiler's path and version; the
source; the flags; torch's version; the Python ABI), so a cache shared by different machines, or a machine moved
to another CPU, never loads a build made for another CPU. Where they cannot be built, or with
``VERL_MEGATRON_CPU_KERNELS=0``, decoding keeps the torch ops, with one warning saying why. The
two agree to float32 rounding for either target (tests/test_cpu_kernels.py; the panel product:
tests/test_panel_linear.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sysconfig
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["ARCHES", "ARCH_ENV", "DISABLE_ENV", "build_name", "decode_kernels"]

DISABLE_ENV = "VERL_MEGATRON_CPU_KERNELS"
ARCH_ENV = "VERL_MEGATRON_CPU_KERNELS_ARCH"
ARCHES = ("native", "generic")
_SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("decode_kernels.cpp", "panel_linear.cpp")
)
_COMMON_FLAGS = ["-O3", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def _arch(arch: str | None) -> str:
    """The build target: ``arch``, else $VERL_MEGATRON_CPU_KERNELS_ARCH, else ``native``."""
    chosen = (arch or os.environ.get(ARCH_ENV, "") or "native").strip().lower()
    if chosen not in ARCHES:
        raise ValueError(f"{ARCH_ENV}={chosen!r}: expected one of {', '.join(ARCHES)}")
    return chosen


def _flags(arch: str) -> list[str]:
    """Compiler flags of a target. ``generic`` on x86 is x86-64-v2 (SSE4.2): the vector width,
    hence the kernels' summation order, differs from an AVX2/AVX-512 native build, which is what
    the portability tests need; elsewhere it is the compiler's default target."""
    if arch == "native":
        return [*_COMMON_FLAGS, "-march=native"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        return [*_COMMON_FLAGS, "-march=x86-64-v2", "-mtune=generic"]
    return list(_COMMON_FLAGS)


def _cpu_tag() -> str:
    """This CPU's model and instruction-set flags (what ``-march=native`` compiles for)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            # x86 says "model name" / "flags", arm "CPU part" / "Features".
            keys = ("model name", "flags", "CPU implementer", "CPU part", "Features")
            text += "".join(line for line in f if line.startswith(keys))[:8192]
    except OSError:
        text += platform.processor()
    return text


@functools.cache
def _compiler_of(command: str) -> str:
    path = shutil.which(command)
    if path is None:
        return f"{command}: not found"
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        first = (done.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError) as exc:
        first = type(exc).__name__
    return f"{os.path.realpath(path)} {first}"


def _compiler() -> str:
    """The C++ compiler torch's loader will call ($CXX, else c++): resolved path and the first
    line of its ``--version``."""
    return _compiler_of(os.environ.get("CXX", "c++"))


def _source_hash() -> str:
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _python_abi() -> str:
    """The interpreter's extension-module suffix (e.g. ``.cpython-311-x86_64-linux-gnu.so``):
    its version, ABI flags and platform, which the built module is linked for."""
    return sysconfig.get_config_var("EXT_SUFFIX") or ""


def build_name(arch: str | None = None) -> str:
    """The extension's name, which is its cache key: the target, a hash over the machine kind,
    the CPU (native builds only), the compiler, the source, the flags, torch's version and the
    Python ABI (two venvs of other Pythons sharing ``TORCH_EXTENSIONS_DIR`` keep apart)."""
    arch = _arch(arch)
    inputs = {
        "arch": arch,
        "machine": platform.machine(),
        "cpu": _cpu_tag() if arch == "native" else "",
        "compiler": _compiler(),
        "source": _source_hash(),
        "flags": _flags(arch),
        "torch": torch.__version__,
        "python": _python_abi(),
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return f"verl_megatron_decode_kernels_{arch}_{digest}"


def _build(arch: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the pip package's binary is not on it when the venv's python
    # is called without activating the venv.
    with contextlib.suppress(ImportError):
        import ninja

        path = os.environ.get("PATH", "")
        if ninja.BIN_DIR not in path.split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path

    name = build_name(arch)
    with _build_flock(name):
        return load(
            name=name,
            sources=[str(_SOURCES[0])],  # it includes the other source: one translation unit
            extra_cflags=_flags(arch),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


@contextlib.contextmanager
def _build_flock(name: str):
    """Hold an OS lock on the build while torch's loader runs, and drop a lock torch left behind.

    Why: torch's loader guards a build with a plain ``lock`` file that only the process that made
    it removes. A process killed mid-compile (kill -9, a stalled job ended, out of memory) leaves
    it, and every later process waits on it for ever, silently. ``flock`` is released by the
    kernel when its holder dies, so while we hold it no live process of ours is building this
    name and a ``lock`` file found there is stale.
    """
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, verbose=False))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{name}.flock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                warnings.warn(f"removing {stale}, left by a build that was killed", stacklevel=4)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def decode_kernels(arch: str | None = None) -> ModuleType | None:
    """The compiled kernels (float32, CPU; see csrc/decode_kernels.cpp for the exact contracts),
    or None where they are switched off or cannot be built (warned once):

    - ``decode_attention(q [B, G, P, D], k, v [B, G, >= L, D], mask [B, L], scale)`` -> [B, G, P, D];
    - ``decode_step_attention(qkv [B, G, P + 2, D], cos, signed_sin [B, R], k_cache, v_cache
      [B, G, T, D], start, mask [B, start + 1], scale)`` -> [B, G, P, D]: a lean layer's rotary
      embedding, cache write and attention in one pass;
    - ``sample_softmax(scaled_logits [B, V], uniforms [B], block)`` -> (tokens [B], log-probs [B]);
    - ``panel_linear(x [M, K], panels [ceil(N / 16), K, 16], N, bias, epilogue, other)`` -> [M, N]:
      a decoding-size linear that streams the weight (csrc/panel_linear.cpp, packed_linear.py),
      and ``panel_linear_streams()``: whether this build has its AVX-512 tile.

    ``arch``: ``native`` or ``generic`` (default: $VERL_MEGATRON_CPU_KERNELS_ARCH, else
    native); another value is a ValueError. The first call for a target in a process loads, and
    on a new machine compiles, its build.
    """
    arch = _arch(arch)
    with _lock:
        if arch not in _loaded:
            _loaded[arch] = _load(arch)
        return _loaded[arch]


def _load(arch: str) -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if not torch.backends.openmp.is_available():
        # The kernels split their work with torch's OpenMP threads; a torch without them would
        # run them on one thread, slower than the torch ops.
        warnings.warn("CPU decoding kernels not used: this torch is built without OpenMP", stacklevel=3)
        return None
    try:
        return _build(arch)
    except Exception as exc:  # no compiler / ninja / writable cache: the torch ops still work
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        warnings.warn(
            f"CPU decoding kernels not built ({type(exc).__name__}: {first}); decoding uses the "
            f"torch ops (set {DISABLE_ENV}=0 to skip the attempt)",
            stacklevel=3,
        )
        return None
