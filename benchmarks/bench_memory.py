"""Peak memory of the log-prob stage vs the size of the full [B, T, V] float32 logits.

Each implementation runs in a fresh Python process (``--child``), so nothing allocated by the
harness or the other side is counted. The child builds its model and batch, records its resident
set size (RSS), resets the kernel's high-water mark (``/proc/self/clear_refs``), computes the
log-probs of every response token of the batch once, and reads the new high-water mark
(``VmHWM``). The stage's peak is that mark minus the RSS before the stage. Where the reset is not
allowed, ``ru_maxrss`` is used instead and the result says so.

The peak is of memory in use, like ``torch.cuda.max_memory_allocated``, not of the allocator's
cache: before the RSS is recorded the heap's free memory goes back to the OS (glibc's
``malloc_trim``) and every allocation of 256 KiB or more gets its own mapping, given back when
freed (``mallopt``), in both sides' children. Otherwise whatever the model's loading happened to
leave free in the heap serves part of the stage without raising the RSS, or a freed 16 MiB block
is not reused but another hole's pages are touched: the same stage measured 8-206 MiB at
Qwen2.5-0.5B's shape from run to run.

- ours: ``MegatronActor.compute_log_prob`` (micro-batches of ``micro_batch``, vocabulary-parallel
  log-probs: softmax statistics per token, no log-softmax tensor).
- peer: ``AutoModelForCausalLM`` forward on the same micro-batches, the LM head at the response
  positions only (transformers' ``logits_to_keep``, as TRL does), and
  ``log_softmax(logits).gather(labels)``: what a user writes; and the same on the whole batch at
  once, which holds [B, Tr + 1, V] logits.

A large vocabulary (64k in the full run) makes [B, T, V] the dominant term.

Run alone: ``python benchmarks/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import (
    QUICK_SHAPE,
    BatchSizes,
    ModelShape,
    Section,
    alone_parser,
    build_assets,
    child_env,
    error_text,
    full_length_batch,
    run_and_print,
    shape_text,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from verl_megatron.utils.cpu_heap import M_MMAP_THRESHOLD, glibc

MIB = 2**20
IMPLS = {
    "ours": "verl-megatron compute_log_prob",
    "hf": "HF forward + log_softmax",
    "hf_whole_batch": "HF forward + log_softmax, whole batch at once",
}
TENSOR_RATIO = "tensor peak ours / full [B,T,V] float32 logits"


@dataclass(frozen=True)
class MemoryBenchConfig(BatchSizes):
    """Sizes of the log-prob stage whose memory is measured. ``peak_repeats``: fresh children per
    side; the stage peak is their median. One child's RSS peak moves with the BLAS library's
    per-thread buffers and the kernel's pages: ours at Qwen2.5-0.5B's shape measured 59, 75 and
    72 MiB in three children run alone and 173 MiB in a full benchmark run, while the tensor
    peak (32 MiB) repeats exactly."""

    peak_repeats: int = 3
    in_process: tuple[str, ...] = ()
    """sides (keys of ``IMPLS``) measured in the calling process instead of fresh children: only
    for a smoke run that checks the children with another side (these peaks include the caller's
    leftovers)"""

    def logits_bytes(self, rows: int) -> int:
        """float32 logits [rows, T, V]."""
        return rows * self.seq_len * self.shape.vocab_size * 4


# [16, 256, 64k] float32 logits are 1 GiB; one micro-batch of 2 rows is 128 MiB.
FULL = MemoryBenchConfig(
    shape=ModelShape(
        vocab_size=65536, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=704
    ),
    batch=16,
    prompt_len=32,
    response_len=224,
    micro_batch=2,
)
# The quick model's sizes with a larger vocabulary, so the logits still dominate.
QUICK = MemoryBenchConfig(
    shape=replace(QUICK_SHAPE, vocab_size=8192), batch=4, prompt_len=8, response_len=56, micro_batch=2,
    peak_repeats=1, in_process=("hf", "hf_whole_batch"),  # the ours child checks the children's protocol
)  # fmt: skip


# ----------------------------------------------------------------------------- inside the child


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_MMAP_FROM = 256 * 1024  # allocations from this size on get their own mapping during the stage


def _measure_in_use() -> bool:
    """From now on, glibc serves every allocation of ``_MMAP_FROM`` bytes or more with its own
    mapping, given back when freed, and the heap's free memory goes back to the OS; False where
    the C library is not glibc."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, _MMAP_FROM))


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of CPU tensor storage made by the ops run inside the mode and alive at once: the
    stage's memory in use, counted tensor by tensor (like ``torch.cuda.max_memory_allocated``), so
    it repeats exactly from run to run, unlike the RSS (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data pointer -> [bytes, live tensors on it]
        self.now = self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.storages.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            entry = self.storages.get(ptr)
            if entry is None:
                if inputs is None:
                    flat = tree_flatten((args, kwargs))[0]
                    inputs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
                if ptr == 0 or ptr in inputs:  # empty, or a view / in-place result of an input
                    continue
                entry = self.storages[ptr] = [storage.nbytes(), 0]
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


def _batch(cfg: MemoryBenchConfig) -> dict[str, torch.Tensor]:
    return full_length_batch(cfg, torch.Generator().manual_seed(cfg.seed))


def _hf_log_probs(model_dir: str, cfg: MemoryBenchConfig, micro_batch: int | None = None):
    """HF forward + log_softmax over micro-batches of ``micro_batch`` rows (default: cfg's)."""
    from transformers import AutoModelForCausalLM

    micro_batch = micro_batch or cfg.micro_batch
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def stage(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = []
        for start in range(0, cfg.batch, micro_batch):
            mb = {k: t[start : start + micro_batch] for k, t in batch.items()}
            # The LM head at the Tr + 1 positions that predict response tokens (and the last, dropped).
            logits = model(
                input_ids=mb["input_ids"],
                position_ids=mb["position_ids"],
                logits_to_keep=cfg.response_len + 1,
            ).logits[:, :-1]
            out.append(
                torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
            )
        return torch.cat(out)

    return stage


def _ours_log_probs(model_dir: str, cfg: MemoryBenchConfig):
    from bench_update import build_actor

    from verl_megatron.protocol import DataProto

    actor = build_actor(model_dir, mini_batch=cfg.batch, micro_batch=cfg.micro_batch, seed=cfg.seed)

    def stage(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        log_probs, _ = actor.compute_log_prob(
            DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
        )
        return log_probs

    return stage


def child_main(impl: str, model_dir: str, cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Measure one implementation's log-prob stage in this (fresh) process."""
    builders = {
        "ours": _ours_log_probs,
        "hf": _hf_log_probs,
        "hf_whole_batch": lambda path, c: _hf_log_probs(path, c, micro_batch=c.batch),
    }
    stage = builders[impl](model_dir, cfg)
    batch = _batch(cfg)
    in_use = _measure_in_use()
    rss_before = _status_kib("VmRSS")
    reset = _reset_high_water_mark()
    log_probs = stage(batch)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if tuple(log_probs.shape) != (cfg.batch, cfg.response_len) or not torch.isfinite(log_probs).all():
        raise RuntimeError(f"{impl}: log-probs of shape {tuple(log_probs.shape)} or not finite")
    mean_log_prob = float(log_probs.mean())
    del log_probs
    with _LiveBytes() as live:  # the same stage again, its tensors counted one by one
        stage(batch)
    return {
        "rss_before_mib": rss_before / 1024,
        "peak_mib": peak / 1024,
        "stage_peak_mib": (peak - rss_before) / 1024,
        "high_water_mark_reset": reset,
        "in_use_measured": in_use,
        "tensor_peak_mib": live.peak / MIB,
        "mean_log_prob": mean_log_prob,
    }


# ----------------------------------------------------------------------------- harness side


def _start(impl: str, model_dir: str, cfg_file: Path, workdir: Path) -> tuple[subprocess.Popen, Path]:
    """Start the child measuring ``impl``; its result lands in the returned JSON path."""
    out = workdir / f"memory_{impl}.json"
    cmd = [sys.executable, __file__, "--child", impl, "--model-dir", model_dir, "--cfg", str(cfg_file)]
    cmd += ["--json", str(out)]
    # child_env: the harness's thread count, no inherited torch.distributed port.
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    return proc, out


def _finish(impl: str, proc: subprocess.Popen, out: Path) -> dict[str, Any]:
    try:
        _, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if proc.returncode != 0:
        tail = (stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"child '{impl}' exited with {proc.returncode}: {tail}")
    return json.loads(out.read_text())


def _median_child(impl: str, model_dir: str, cfg_file: Path, workdir: Path, repeats: int) -> dict[str, Any]:
    """The child of ``impl`` run ``repeats`` times, one after another: the result of the one with
    the median stage peak, with every child's peak under ``stage_peaks_mib``."""
    runs = []
    for repeat in range(repeats):
        folder = workdir / f"{impl}_{repeat}"
        folder.mkdir(parents=True, exist_ok=True)
        runs.append(_finish(impl, *_start(impl, model_dir, cfg_file, folder)))
    runs.sort(key=lambda r: r["stage_peak_mib"])
    return {**runs[len(runs) // 2], "stage_peaks_mib": [r["stage_peak_mib"] for r in runs]}


def run(cfg: MemoryBenchConfig, workdir: Path) -> Section:
    """Peak RSS of the log-prob stage, ours and HF, next to the size of the full logits."""
    model_dir, _ = build_assets(workdir / "memory_model", cfg.shape, cfg.seed)
    return measure(cfg, model_dir, workdir)


def measure(
    cfg: MemoryBenchConfig, model_dir: str, workdir: Path, impls: tuple[str, ...] = tuple(IMPLS)
) -> Section:
    """:func:`run` on an existing checkpoint, for the sides ``impls`` (keys of ``IMPLS``); the
    children write their results to ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    full_mib = cfg.logits_bytes(cfg.batch) / MIB
    micro_mib = cfg.logits_bytes(cfg.micro_batch) / MIB
    section = Section(
        name="memory",
        title="Log-prob stage memory: peak RSS above the pre-stage level vs full [B, T, V] float32 logits",
        columns=[
            "impl",
            "stage peak MiB",
            "full [B,T,V] logits MiB",
            "peak / full logits",
            "peak / micro-batch logits",
            "tensor peak MiB",
        ],
        config={
            "model": shape_text(cfg.shape),
            "B": cfg.batch,
            "T": f"{cfg.prompt_len}+{cfg.response_len}",
            "V": cfg.shape.vocab_size,
            "micro_batch": cfg.micro_batch,
            "threads": torch.get_num_threads(),
        },
    )
    cfg_file = workdir / "memory_cfg.json"
    cfg_file.write_text(json.dumps(asdict(cfg)))
    results = {}
    for impl, label in ((impl, IMPLS[impl]) for impl in impls):
        try:
            if impl in cfg.in_process:
                one = child_main(impl, model_dir, cfg)
                results[impl] = {**one, "stage_peaks_mib": [one["stage_peak_mib"]]}
            else:
                results[impl] = _median_child(impl, model_dir, cfg_file, workdir, cfg.peak_repeats)
        except Exception as exc:
            section.errors[label] = error_text(exc)
            continue
        peak = results[impl]["stage_peak_mib"]
        section.rows.append(
            {
                "impl": label,
                "stage peak MiB": peak,
                "full [B,T,V] logits MiB": full_mib,
                "peak / full logits": peak / full_mib,
                "peak / micro-batch logits": peak / micro_mib,
                "tensor peak MiB": results[impl]["tensor_peak_mib"],
            }
        )
        if not results[impl]["high_water_mark_reset"]:
            section.notes.append(f"{label}: /proc/self/clear_refs not writable; peak from ru_maxrss")
    if "ours" in results:
        section.ratios["stage peak ours / full [B,T,V] float32 logits"] = (
            results["ours"]["stage_peak_mib"] / full_mib
        )
        section.ratios[TENSOR_RATIO] = results["ours"]["tensor_peak_mib"] / full_mib
    for peer in ("hf", "hf_whole_batch"):
        if "ours" in results and peer in results:
            section.ratios[f"stage peak ours / {IMPLS[peer]}"] = results["ours"]["stage_peak_mib"] / max(
                results[peer]["stage_peak_mib"], 1e-9
            )
    section.notes.append(
        "stage peak: RSS high-water mark above the pre-stage RSS, memory in use (heap trimmed, 256 KiB "
        "and larger blocks mapped alone); it still moves from run to run with the BLAS library's "
        f"per-thread buffers, so it is the median over {cfg.peak_repeats} fresh child process(es) per side, run one "
        "after another (every child's peak: extra.raw[side].stage_peaks_mib). tensor peak: bytes of the tensors alive at once during a second run "
        "of the stage, which repeats exactly"
    )
    section.notes.append(
        f"one micro-batch of logits [{cfg.micro_batch}, T, V] float32 is {micro_mib:.0f} MiB; "
        + (
            f"in the harness's process: {', '.join(cfg.in_process)}; any other side in a fresh process"
            if cfg.in_process
            else "each side runs in its own fresh process"
        )
    )
    section.extra = {"raw": results, "config": asdict(cfg)}
    return section


def main() -> None:
    parser = alone_parser(__doc__)
    parser.add_argument("--child", choices=list(IMPLS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        raw = json.loads(Path(args.cfg).read_text())
        cfg = MemoryBenchConfig(**{**raw, "shape": ModelShape(**raw["shape"])})
        Path(args.json).write_text(json.dumps(child_main(args.child, args.model_dir, cfg)))
        return
    run_and_print(run, QUICK if args.quick else FULL, args.threads)


if __name__ == "__main__":
    main()
