"""Shared pieces of the benchmark harness: machine description, timing, FLOP counts, result files.

Every benchmark section returns a :class:`Section`: a table of rows (one per implementation or
setting), the ratios ours / peer, notes and the configuration it ran. ``run.py`` prints each as
markdown and saves it as JSON beside a markdown copy, with the machine description attached.

Timing on a shared machine: implementations that are compared are run *interleaved* (A, B, A,
B, ...) after a warm-up call each, so a burst of load from other processes hits both sides alike;
the headline is the fastest repeat (least disturbed), the median is reported beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# The scripts run from a checkout (`python benchmarks/run.py`), installed with `pip install -e .` or not.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

HEADLINE_THREADS = 2
SHARED_HEAP_NOTE = (
    "both sides ran in one process, after verl-megatron's runtime had set glibc's malloc thresholds "
    "for it (verl_megatron/utils/cpu_heap.py: freed memory is reused instead of page-faulted in "
    "again), so the peer ran with the same allocator setting"
)

# Per-token FLOPs, stated in every result that uses them. N counts the parameters that take part in
# a matmul (everything but the input embedding table, which is a lookup); the attention term counts
# the full T x T score matrix for QK^T and AV, as PaLM's MFU convention does.
FLOPS_FORMULA_TRAIN = "6*N + 12*L*T*d_attn  (N = matmul params incl. LM head, excl. input embedding; d_attn = heads*head_dim; T = sequence length)"
FLOPS_FORMULA_FORWARD = "2*N + 4*L*T*d_attn  (forward only)"


# ----------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; None where it is not readable."""
    try:
        cores, phys = set(), "0"
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":", 1)[1].strip()
                elif line.startswith("core id"):
                    cores.add((phys, line.split(":", 1)[1].strip()))
        return len(cores) or None
    except OSError:
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, cores, threads in use, load and library versions: attached to every result."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "physical_cores": _physical_cores(),
        "logical_cpus": os.cpu_count(),
        "cpus_usable_by_process": affinity,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_gib": _memory_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            name: _version(name)
            for name in ("torch", "transformers", "megatron-core", "trl", "accelerate", "numpy")
        },
    }


def child_env() -> dict[str, str]:
    """Environment for a benchmark's subprocess: the repo importable, this process's thread count,
    and none of the torch.distributed variables an in-process runtime left behind (a child that
    inherited MASTER_PORT would try to listen on the parent's port)."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@contextlib.contextmanager
def single_process_env() -> Iterator[None]:
    """Hide the torch.distributed variables an in-process runtime left behind, for a peer that
    must run as one plain process (accelerate reads LOCAL_RANK / WORLD_SIZE to pick DDP)."""
    saved = {k: os.environ.pop(k) for k in _DIST_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return round(kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def machine_line(info: dict[str, Any]) -> str:
    """One markdown line describing the machine, for the top of each table."""
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    return (
        f"{info['cpu_model']}, {info['physical_cores']} cores / {info['logical_cpus']} logical CPUs, "
        f"{info['torch_threads']} torch threads, load avg {info['load_average_1m']}, "
        f"{info['memory_gib']} GiB RAM; {versions}"
    )


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Seconds of each timed repeat (warm-up excluded)."""

    seconds: list[float]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {"best_s": self.best, "median_s": self.median, "repeats_s": self.seconds}


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, alternating between them (A B A B ...).

    Each gets ``warmup`` untimed calls first (allocator, lazy init, thread pools).
    """
    if repeats < 1:
        raise ValueError(f"time_interleaved: repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - start)
    return {name: Timing(s) for name, s in seconds.items()}


def time_once(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds for one call, and its return value."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# ----------------------------------------------------------------------------- FLOPs


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a llama-style decoder that FLOP counts and matmul shapes need."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    """the LM head is the input embedding table (Qwen2.5-0.5B); FLOPs are the same either way"""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def d_attn(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Weights used in a matmul per token: q, k, v, o, gate/up/down per layer, plus the LM head."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = h * self.d_attn + 2 * h * kv + self.d_attn * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer + self.head_params

    @property
    def head_params(self) -> int:
        """Weights of the LM head (h x V), a part of :attr:`matmul_params`."""
        return self.hidden_size * self.vocab_size

    def gemm_shapes(self, tokens: int) -> list[tuple[int, int, int]]:
        """(M, K, N) of the forward matmuls for ``tokens`` rows: the shapes the peak is measured at."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return [
            (tokens, h, self.d_attn),  # q
            (tokens, h, kv),  # k, v
            (tokens, self.d_attn, h),  # o
            (tokens, h, self.intermediate_size),  # gate, up
            (tokens, self.intermediate_size, h),  # down
            (tokens, h, self.vocab_size),  # LM head
        ]


# The smoke-run (--quick) model of every section that builds a llama: numbers mean nothing.
QUICK_SHAPE = ModelShape(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)
# The full-run model of the update sections, the size the megatron-on-cpu notes timed decoding at:
# 4 layers, hidden 512, GQA 8/2, vocabulary 32k.
MEDIUM_SHAPE = ModelShape(
    vocab_size=32000, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1408
)
# Qwen2.5-0.5B's sizes (494M parameters, the LM head tied to the embedding): the real_shape section.
QWEN25_05B_SHAPE = ModelShape(151936, 896, 24, 14, 2, 4864, tie_word_embeddings=True)
# The full-run model of the sections that time many whole GRPO steps (scaling sweeps, bypass).
SMALL_SHAPE = ModelShape(
    vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=352
)


def train_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Forward + backward FLOPs per token; see FLOPS_FORMULA_TRAIN."""
    return 6.0 * shape.matmul_params + 12.0 * shape.num_layers * seq_len * shape.d_attn


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token; see FLOPS_FORMULA_FORWARD."""
    return 2.0 * shape.matmul_params + 4.0 * shape.num_layers * seq_len * shape.d_attn


# Model FLOPs and spent FLOPs, side by side in every section that reports an MFU.
FLOPS_MODEL_SPENT_NOTE = (
    "MFU on model FLOPs counts the conventional work (training: every position of every sequence "
    "through every matmul, the LM head included; generation: 2 x matmul params per generated token); "
    "MFU on spent FLOPs counts what each side runs (the LM head only at the rows it computes, a "
    "shared prompt once, a prefill at the positions it runs). Attention in both: 4 x layers x d_attn "
    "per query-key pair, every key up to the sequence's (or the cache's) length."
)
MFU_MODEL, MFU_SPENT = "MFU % (model FLOPs)", "MFU % (spent FLOPs)"


def forward_flops(shape: ModelShape, positions: float, head_rows: float, pairs: float) -> float:
    """Forward FLOPs of a pass that runs the layers at ``positions`` positions, the LM head at
    ``head_rows`` of them and attention over ``pairs`` query-key pairs (a training pass: 3x)."""
    body = shape.matmul_params - shape.head_params
    return (
        2.0 * (body * positions + shape.head_params * head_rows)
        + 4.0 * shape.num_layers * shape.d_attn * pairs
    )


def generation_flops(
    shape: ModelShape, batch: int, prefill: tuple[int, int], cache_len: int, new_tokens: int
) -> dict[str, float]:
    """``model`` and ``spent`` FLOPs of generating ``new_tokens`` for ``batch`` rows.

    model: 2 x matmul params per generated token. spent: a prefill of ``prefill`` = (positions,
    rows) (the LM head at each row's last position; queries against ``cache_len`` prompt keys),
    then ``new_tokens - 1`` one-token steps per row against the growing cache.
    """
    (positions, rows), steps = prefill, batch * (new_tokens - 1)
    pairs = positions * cache_len + batch * sum(cache_len + k for k in range(1, new_tokens))
    return {
        "model": 2.0 * shape.matmul_params * batch * new_tokens,
        "spent": forward_flops(shape, positions + steps, rows + steps, pairs),
    }


def mfu_columns(flops: dict[str, float], seconds: float, peak_gflops: float) -> dict[str, float]:
    """``MFU % (model FLOPs)`` and ``MFU % (spent FLOPs)`` of ``flops`` done in ``seconds``."""
    rate = 1e9 * peak_gflops * seconds
    return {MFU_MODEL: 100 * flops["model"] / rate, MFU_SPENT: 100 * flops["spent"] / rate}


def measure_matmul_peak(
    shapes: Sequence[tuple[int, int, int]], repeats: int = 5, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Best FLOP/s of ``torch.matmul`` at each (M, K, N), with the current thread count.

    The peak is the best over the shapes: the dense rate this machine reaches on this model's own
    matmuls, the denominator of the CPU MFU.
    """
    per_shape = []
    for m, k, n in dict.fromkeys(shapes):  # unique, order kept
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up: thread pool and packing buffers
        best = min(time_once(lambda a=a, b=b: torch.matmul(a, b))[0] for _ in range(repeats))
        per_shape.append({"m": m, "k": k, "n": n, "gflops": 2.0 * m * k * n / best / 1e9})
    peak = max(row["gflops"] for row in per_shape)
    return {"peak_gflops": peak, "threads": torch.get_num_threads(), "dtype": str(dtype), "shapes": per_shape}


def measure_copy_bandwidth(mib: int = 256, repeats: int = 3) -> float:
    """Best GB/s of copying a ``mib`` MiB float32 tensor (bytes read + bytes written): the rate
    that bounds a step which streams every weight once."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages
    best = min(time_once(lambda: dst.copy_(src))[0] for _ in range(repeats))
    return 2 * src.numel() * 4 / best / 1e9


def best_peak(*measurements: dict[str, Any]) -> dict[str, Any]:
    """Combine peak measurements taken at different times (before / after a timed section): the
    best rate per shape. On a shared machine one measurement may fall into a burst of load."""
    shapes: dict[tuple[int, int, int], dict[str, Any]] = {}
    for m in measurements:
        for row in m["shapes"]:
            key = (row["m"], row["k"], row["n"])
            if key not in shapes or row["gflops"] > shapes[key]["gflops"]:
                shapes[key] = row
    rows = list(shapes.values())
    return {
        **measurements[0],
        "peak_gflops": max(r["gflops"] for r in rows),
        "shapes": rows,
        "measurements": len(measurements),
    }


def build_assets(out_dir: Path, shape: ModelShape, seed: int = 0) -> tuple[str, Any]:
    """A random-init llama of ``shape`` with a character tokenizer saved beside it, in ``out_dir``.

    The model's vocabulary is larger than the tokenizer's (about 100 characters): sampled ids past
    the tokenizer decode to nothing, which keeps text rewards cheap and the vocabulary realistic.
    """
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(out_dir / "tokenizer")
    # ModelShape's fields are build_tiny_hf_model's size arguments, name for name.
    build_tiny_hf_model(out_dir, "llama", **asdict(shape), seed=seed, tokenizer=tokenizer)
    return str(out_dir), tokenizer


@dataclass(frozen=True)
class BatchSizes:
    """One stage's batch: ``batch`` rows of ``prompt_len + response_len`` tokens, no padding, run
    in micro-batches of ``micro_batch`` rows on a llama of ``shape``; ``seed`` fixes its tokens."""

    shape: ModelShape
    batch: int
    prompt_len: int
    response_len: int
    micro_batch: int
    seed: int = 0

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


def full_length_batch(sizes: BatchSizes, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random prompts and responses of ``sizes`` in verl's keys, every row full length.

    Returns ``prompts`` [B, Tp], ``responses`` [B, Tr], ``input_ids`` / ``attention_mask`` /
    ``position_ids`` [B, Tp + Tr] and ``response_mask`` [B, Tr]; token ids are drawn from
    ``[3, vocab)`` (never pad / bos / eos) with ``gen``.
    """
    b, tp, tr = sizes.batch, sizes.prompt_len, sizes.response_len
    input_ids = torch.randint(3, sizes.shape.vocab_size, (b, tp + tr), generator=gen)
    return {
        "prompts": input_ids[:, :tp],
        "responses": input_ids[:, tp:],
        "input_ids": input_ids,
        "attention_mask": torch.ones(b, tp + tr, dtype=torch.long),
        "position_ids": torch.arange(tp + tr).expand(b, -1).contiguous(),
        "response_mask": torch.ones(b, tr, dtype=torch.long),
    }


def shape_text(shape: ModelShape) -> str:
    """``llama L4 h512 heads 8/2 ffn 1408 V32000``: the model, in one table cell."""
    return (
        f"llama L{shape.num_layers} h{shape.hidden_size} heads {shape.num_heads}/{shape.num_kv_heads} "
        f"ffn {shape.intermediate_size} V{shape.vocab_size}{' tied' if shape.tie_word_embeddings else ''}"
    )


# ----------------------------------------------------------------------------- results


@dataclass
class Section:
    """One benchmark's result: a table, ratios ours / peer, notes, the configuration it ran."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    seconds: float | None = None

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        if self.config:
            lines += ["config: " + ", ".join(f"{k}={_fmt(v)}" for k, v in self.config.items()), ""]
        if self.rows:
            lines.append(markdown_table(self.columns, self.rows))
            lines.append("")
        for key, value in self.ratios.items():
            lines.append(f"- **{key}**: {_fmt(value)}")
        for note in self.notes:
            lines.append(f"- {note}")
        for who, err in self.errors.items():
            lines.append(f"- **{who} could not run**: `{err}`")
        return "\n".join(lines).rstrip() + "\n"

    def to_json(self, machine: dict[str, Any]) -> dict[str, Any]:
        return {**asdict(self), "machine": machine}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-2):
            return f"{value:.3g}"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned, missing cells as n/a."""
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows if r.get(c) is not None) for c in columns]
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---:" if num else "---" for num in numeric) + "|"
    body = ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def ratio(ours: float | None, peer: float | None) -> float | None:
    """ours / peer, or None when either side is missing or the peer is zero."""
    if ours is None or peer is None or peer == 0 or not math.isfinite(ours) or not math.isfinite(peer):
        return None
    return ours / peer


def write_section(out_dir: Path, section: Section, machine: dict[str, Any]) -> tuple[Path, Path]:
    """Save ``<name>.json`` and ``<name>.md`` under ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{section.name}.json", out_dir / f"{section.name}.md"
    json_path.write_text(json.dumps(section.to_json(machine), indent=2, default=str) + "\n")
    md_path.write_text(section.to_markdown())
    return json_path, md_path


def error_text(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line, trimmed: what a result file records for a side that failed."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log(y) on log(x): y ~ x^k. None with fewer than two usable points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def alone_parser(doc: str) -> argparse.ArgumentParser:
    """The options every ``bench_<name>.py`` run by itself takes: ``--quick`` (smoke sizes) and
    ``--threads`` (headline: 2); a script adds its own to it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    parser.add_argument("--threads", type=int, default=HEADLINE_THREADS, help="torch threads (headline: 2)")
    return parser


def run_and_print(run: Callable[[Any, Path], Section], cfg: Any, threads: int) -> Section:
    """Run one section in a temporary folder with ``threads`` torch threads; print the machine and
    the section's table (nothing is written)."""
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="verl_megatron_bench_") as tmp:
        section = run(cfg, Path(tmp))
    print(machine_line(machine_info()))
    print(section.to_markdown())
    return section


def run_alone(doc: str, run: Callable[[Any, Path], Section], full: Any, quick: Any) -> None:
    """The command line of a ``bench_<name>.py`` run by itself (see :func:`alone_parser`)."""
    args = alone_parser(doc).parse_args()
    run_and_print(run, quick if args.quick else full, args.threads)
