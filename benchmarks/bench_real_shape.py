"""The comparisons at a real model's shape: Qwen2.5-0.5B's sizes, float32, on the headline threads.

The other sections use a 28M-parameter model. Here one random-init checkpoint of Qwen2.5-0.5B's
shape (24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864, vocabulary 151936, LM head tied
to the embedding: 494M parameters; llama layout, i.e. without Qwen2's q/k/v biases, 0.006% of
the weights) is built on the spot and the other sections' code runs on it, sized to a few
minutes on 2 cores:

- generation: ``bench_generate`` (native engine vs HF ``generate``, same weights, sampling, EOS
  ignored; our timed calls name one weights version, so they reuse the packed weights, and a cold
  call that packs them is reported beside them), plus a one-token call of ours that times its
  prefill alone, and one call per side at a larger batch (``large_batch``) on the same models;
- update: ``bench_update``'s two PPO updates (ours vs plain PyTorch + AdamW with
  ``logits_to_keep``) under ``bench_profile``'s stage clock, one side after the other (both at
  once would hold ~16 GB of weights, gradients and Adam moments);
- GRPO step: ``bench_grpo_step``, ours on-policy vs TRL ``GRPOTrainer`` (the same passes);
- log-prob memory: ``bench_memory``, each side in its own process.

One table, a row per stage and side; the ratios are named after issue 32's targets
(``report.TARGETS``), and for each stage a note says where the time goes and what bounds it.

Run alone: ``python benchmarks/bench_real_shape.py [--quick]``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import bench_generate
import bench_grpo_step
import bench_memory
import bench_profile
import bench_update
import torch
from bench_generate import GenerateBenchConfig, GreedyCheck
from bench_grpo_step import GRPOBenchConfig
from bench_memory import MemoryBenchConfig
from bench_update import UpdateBenchConfig
from common import (
    FLOPS_MODEL_SPENT_NOTE,
    MFU_MODEL,
    MFU_SPENT,
    QUICK_SHAPE,
    QWEN25_05B_SHAPE,
    ModelShape,
    Section,
    Timing,
    best_peak,
    build_assets,
    error_text,
    measure_copy_bandwidth,
    measure_matmul_peak,
    run_alone,
    shape_text,
)
from report import TARGETS, target_text

NAME = "real_shape"
GEN = "generation tokens/s native / HF generate (best; same weights, sampling)"
GEN_MFU = "generation MFU native, model FLOPs (2 x params x tokens/s / matmul peak)"
GEN_MFU_SPENT = "generation MFU native, spent FLOPs (fraction of matmul peak)"
GEN_COLD = "generation seconds native cold call (packing included) / best warm call"
GEN_LARGE = "generation tokens/s native / HF generate, large batch (one call each; batch in config)"
GEN_LARGE_MFU = "generation MFU native, large batch, model FLOPs (fraction of matmul peak)"
UPDATE = "update tokens/s ours / plain PyTorch + AdamW (best)"
UPDATE_MFU = "update CPU MFU ours, model FLOPs (fraction of matmul peak)"
UPDATE_MFU_SPENT = "update CPU MFU ours, spent FLOPs (fraction of matmul peak)"
GRPO = "GRPO step time ours on-policy / TRL GRPOTrainer (best; same passes)"
MEMORY = "log-prob stage peak ours / full [B,T,V] float32 logits"
MEMORY_TENSORS = "log-prob stage tensor peak ours / full [B,T,V] float32 logits (repeats exactly)"
RATIOS = (
    GEN,
    GEN_MFU,
    GEN_MFU_SPENT,
    GEN_COLD,
    GEN_LARGE,
    GEN_LARGE_MFU,
    UPDATE,
    UPDATE_MFU,
    UPDATE_MFU_SPENT,
    GRPO,
    MEMORY,
    MEMORY_TENSORS,
)
COLUMNS = ["stage", "impl", "seconds (best)", "tokens/s (best)", MFU_MODEL, MFU_SPENT, "peak / full logits"]


@dataclass(frozen=True)
class RealShapeConfig:
    """Each stage's sizes; all four run on one checkpoint of ``generation.shape``."""

    generation: GenerateBenchConfig
    update: UpdateBenchConfig
    grpo: GRPOBenchConfig
    memory: MemoryBenchConfig

    def __post_init__(self) -> None:
        shapes = {stage: getattr(self, stage).shape for stage in ("update", "grpo", "memory")}
        wrong = [stage for stage, shape in shapes.items() if shape != self.shape]
        if wrong:
            raise ValueError(
                f"RealShapeConfig: {wrong} must run on the generation stage's model {self.shape}"
            )

    @property
    def shape(self) -> ModelShape:
        return self.generation.shape


FULL = RealShapeConfig(
    generation=GenerateBenchConfig(
        QWEN25_05B_SHAPE, batch=16, prompt_len=32, new_tokens=32, repeats=2, check=GreedyCheck(2, 8),
        static_cache=False, large_batch=64, large_new_tokens=128,
    ),
    update=UpdateBenchConfig(
        shape=QWEN25_05B_SHAPE, batch=4, prompt_len=32, response_len=96, micro_batch=2, repeats=2
    ),
    # Two warm-up steps: on the CI machine the second step's first rewrite of the packed decoding
    # weights (in place, into the first step's buffers) took 1.3-2.0 s against 0.25 s from the third
    # step on (2 threads; 1.4-1.6 vs 0.5-0.7 s at 1 thread, three runs), a one-time cost.
    grpo=GRPOBenchConfig(
        QWEN25_05B_SHAPE, prompts=2, group=4, prompt_len=32, response_len=32, micro_batch=4, steps=1,
        warmup=2, rounds=1,
    ),
    memory=MemoryBenchConfig(shape=QWEN25_05B_SHAPE, batch=8, prompt_len=32, response_len=96, micro_batch=1),
)  # fmt: skip
_TINY = replace(QUICK_SHAPE, tie_word_embeddings=True)
QUICK = RealShapeConfig(
    generation=replace(bench_generate.QUICK, shape=_TINY, large_batch=8, large_new_tokens=12),
    update=replace(bench_update.QUICK, shape=_TINY),
    grpo=replace(bench_grpo_step.QUICK, shape=_TINY),
    # one checkpoint for all stages: V 512. In-process: the memory section's quick run already
    # runs a child, and the two here cost ~14 CPU s, most of a quick run's section.
    memory=replace(bench_memory.QUICK, shape=_TINY, in_process=("ours", "hf_whole_batch")),
)


# ----------------------------------------------------------------------------- stages


def _generation(cfg: RealShapeConfig, model_dir: str, tokenizer: Any, section: Section) -> Section:
    part = bench_generate.measure(cfg.generation, model_dir, tokenizer)
    rows = {row["impl"]: row for row in part.rows}
    g = cfg.generation
    stages = [
        ("generation", impl, impl)
        for impl in (bench_generate.NATIVE, bench_generate.HF, bench_generate.NATIVE_COLD)
    ]
    stages += [
        (f"generation, batch {g.large_batch}", impl, bench_generate.at_batch(impl, g.large_batch))
        for impl in (bench_generate.NATIVE, bench_generate.HF)
    ]
    for stage, impl, name in stages:
        if name in rows:
            section.rows.append(_row(stage, impl, rows[name], "seconds (best)", "tokens/s (best)"))
    section.ratios[GEN] = part.ratios.get("tokens/s native / HF generate (best)")
    section.ratios[GEN_MFU] = part.ratios.get("MFU native, model FLOPs (fraction of matmul peak)")
    section.ratios[GEN_MFU_SPENT] = part.ratios.get("MFU native, spent FLOPs (fraction of matmul peak)")
    section.ratios[GEN_COLD] = part.ratios.get("seconds native cold call (packing included) / best warm call")
    section.ratios[GEN_LARGE] = part.ratios.get(
        f"tokens/s native / HF generate at batch {g.large_batch} (one call each)"
    )
    section.ratios[GEN_LARGE_MFU] = part.ratios.get(
        f"MFU native at batch {g.large_batch}, model FLOPs (fraction of matmul peak)"
    )
    if bench_generate.NATIVE in rows:
        section.notes.append(_generation_note(cfg, rows, part.extra, measure_copy_bandwidth()))
    return part


def _large_call_text(g: GenerateBenchConfig) -> str:
    big = g.large_call
    return f"; large batch: {big.batch} rows, {big.new_tokens} new tokens" if big else ""


def _generation_note(
    cfg: RealShapeConfig, rows: dict[str, dict[str, Any]], extra: dict, bandwidth: float
) -> str:
    """Where ours' generation time goes (prefill, steps, packing) and, at each batch, the two
    floors of a decoding step's time and the MFU they allow."""
    g, shape, prefill_s = cfg.generation, cfg.shape, extra["native_prefill_s"]
    warm, peak = rows[bench_generate.NATIVE]["seconds (best)"], extra["matmul_peak"]["peak_gflops"]
    step_ms = 1000 * (warm - prefill_s) / max(g.new_tokens - 1, 1)
    weights_gb = 4 * shape.matmul_params / 1e9
    read_ms = 1000 * weights_gb / bandwidth

    def bound(call: GenerateBenchConfig) -> str:
        batch, new_tokens = call.batch, call.new_tokens
        matmul_ms = 2e3 * shape.matmul_params * batch / peak / 1e9
        # The whole call with every step at its floor and the prefill as measured (scaled by rows).
        call_s = prefill_s * batch / g.batch + (new_tokens - 1) * max(matmul_ms, read_ms) / 1000
        call_mfu = 2 * shape.matmul_params * batch * new_tokens / (peak * 1e9 * call_s)
        return (
            f"at batch {batch} ({new_tokens} new tokens) its matmuls take >= {matmul_ms:.0f} ms at the matmul peak, against >= "
            f"{read_ms:.0f} ms to read the weights, so a step's MFU is at most "
            f"{matmul_ms / max(matmul_ms, read_ms):.2f} and a call's, with every step at that floor, "
            f"{call_mfu:.2f}"
        )

    large = bench_generate.at_batch(bench_generate.NATIVE, g.large_batch) if g.large_batch else None
    large_text = (
        f"; {bound(g.large_call)} (measured: {rows[large]['seconds (best)']:.2f} s for {g.large_batch} rows, "
        f"MFU {rows[large][MFU_MODEL] / 100:.3f})"
        if large in rows
        else ""
    )
    return (
        f"generation, where the time goes: ours {warm:.2f} s = prefill of {g.batch} prompts "
        f"{prefill_s:.2f} s + {g.new_tokens - 1} one-token steps of {g.batch} rows at {step_ms:.0f} ms each. "
        f"The timed calls name one weights version, so they reuse their packed weights (16-column panels "
        f"for the steps' products of up to 64 rows, streamed once per step by the compiled panel kernel; "
        f"oneDNN's layout for the prefill; rollout.keep_packed_weights); a cold call at a new version packs "
        f"{extra['native_cold_packs']} weights "
        f"first: {extra['native_cold_s']:.2f} s (the first rollout after each update pays it). "
        f"What bounds it: a step reads every weight once ({weights_gb:.2f} GB float32; at the measured copy "
        f"bandwidth {bandwidth:.1f} GB/s >= {read_ms:.0f} ms) and does 2 x rows FLOPs per weight; "
        f"{bound(g)}{large_text}. The prefill is compute-bound, so a whole call's MFU can exceed a step's"
    )


def _update(cfg: RealShapeConfig, model_dir: str, section: Section) -> dict[str, Any]:
    u = cfg.update
    gemms = u.shape.gemm_shapes(u.micro_batch * u.seq_len)
    peak_before = measure_matmul_peak(gemms, repeats=3)
    profiles = bench_profile.profile_sides(u, model_dir, together=False)
    peak = best_peak(peak_before, measure_matmul_peak(gemms, repeats=3))
    impls = {"ours": bench_update.OURS, "peer": bench_update.PEER}
    timings = {impls[side]: Timing(result["seconds"]) for side, result in profiles.items()}
    rows = bench_update.update_rows(u, timings, peak["peak_gflops"])
    for row in rows:
        section.rows.append(_row("update", row["impl"], row, "step_s (best)", "tokens/s (best)"))
    ratios = bench_update.update_ratios(rows)
    section.ratios[UPDATE] = ratios["tokens/s ours / HF (best)"]
    section.ratios[UPDATE_MFU] = ratios["CPU MFU ours (fraction of matmul peak)"]
    section.ratios[UPDATE_MFU_SPENT] = ratios["CPU MFU ours, spent FLOPs (fraction of matmul peak)"]
    section.notes.append(bench_update.peak_note(u, peak))
    section.notes.append(_update_note(profiles))
    return {"profile": profiles, "matmul_peak": peak, "flops": bench_update.update_flops(u)}


def _update_note(profiles: dict[str, dict[str, Any]]) -> str:
    def stages(side: str, total: str = "best", split: str = "stages") -> str:
        result = profiles[side]
        parts = [f"{name} {s:.2f} s" for name, s in result[split].items() if s >= 0.01 * result[total]]
        return f"{result[total]:.2f} s = " + ", ".join(parts)

    return (
        f"update, where the time goes (stage clock of bench_profile, fastest repeat): ours {stages('ours')}; "
        f"peer {stages('peer')}. Process CPU seconds (all threads; a loaded machine inflates them far less "
        f"than wall time), repeat with the least: ours {stages('ours', 'best_cpu', 'cpu_stages')}; peer "
        f"{stages('peer', 'best_cpu', 'cpu_stages')}. What bounds it: forward and backward are float32 matmuls on both sides "
        "(their rate against the matmul peak is the MFU); the optimizer step streams the weights, "
        "gradients and both Adam moments (4 x 4 bytes per parameter read and written) and is memory-bound"
    )


def _grpo(cfg: RealShapeConfig, model_dir: str, tokenizer: Any, workdir: Path, section: Section) -> Section:
    impls = (bench_grpo_step.OURS_ON_POLICY, bench_grpo_step.TRL)
    workdir.mkdir(parents=True, exist_ok=True)
    part = bench_grpo_step.measure(cfg.grpo, model_dir, tokenizer, workdir, impls=impls)
    g = cfg.grpo
    tokens = g.prompts * g.group * (g.prompt_len + g.response_len)
    rows = {row["impl"]: row for row in part.rows}
    for impl in impls:
        if impl in rows:
            row = {**rows[impl], "tokens/s": tokens / rows[impl]["step_s (best)"]}
            section.rows.append(_row("GRPO step", impl, row, "step_s (best)", "tokens/s"))
    section.ratios[GRPO] = part.ratios.get("step time ours on-policy / TRL (best; same passes as TRL)")
    ours, trl = rows.get(bench_grpo_step.OURS_ON_POLICY), rows.get(bench_grpo_step.TRL)
    if ours is not None and trl is not None:
        section.notes.append(_grpo_note(cfg, part, ours, trl))
    return part


def _grpo_note(cfg: RealShapeConfig, part: Section, ours: dict[str, Any], trl: dict[str, Any]) -> str:
    """Where ours' GRPO step goes by stage (wall and process CPU seconds), each part's MFU on the
    FLOPs it spends, and what the 0.5 target asks of the step."""
    raw = part.extra["raw"][bench_grpo_step.OURS_ON_POLICY]
    flops = part.extra["stage_flops"][bench_grpo_step.OURS_ON_POLICY]
    peak = part.extra["matmul_peak"]["peak_gflops"]
    wall = bench_grpo_step.best_step_stages(raw)
    cpu = bench_grpo_step.best_step_stages(raw, "stage_cpu_seconds")
    shown = [stage for stage in bench_grpo_step.STAGES if stage in wall and wall[stage] >= 0.005]
    stages = ", ".join(
        f"{stage} {wall[stage]:.2f} s" + (f" (CPU {cpu[stage]:.2f} s)" if stage in cpu else "")
        for stage in shown
    )

    def mfu(stage: str) -> str:
        spent = flops[stage]["spent"]
        return (
            f"{100 * spent / (1e9 * peak * wall[stage]):.0f}% of the matmul peak on {spent / 1e9:.0f} GFLOP"
        )

    g, budget = cfg.grpo, 0.5 * trl["step_s (best)"]
    return (
        f"GRPO step, where the time goes: ours on-policy {ours['step_s (best)']:.2f} s (process CPU "
        f"{ours[bench_grpo_step.STEP_CPU]:.2f} s) = {stages}; TRL {trl['step_s (best)']:.2f} s (CPU "
        f"{trl[bench_grpo_step.STEP_CPU]:.2f} s; it does not time its stages). Spent-FLOP MFU by part: "
        f"generation {mfu('gen')} ({g.response_len - 1} one-token steps of {g.prompts * g.group} rows, each "
        f"reading every weight: memory-bound), update {mfu('update_actor')} (forward + backward matmuls, "
        "compute-bound, plus AdamW, clipping and zeroing the gradient buffer, which stream every parameter: "
        f"memory-bound). The 0.5 target asks for ours <= {budget:.2f} s: "
        + _gap_text(ours["step_s (best)"], budget)
    )


def _gap_text(seconds: float, budget: float) -> str:
    gap = seconds - budget
    return f"{gap:.2f} s less than now" if gap > 0 else f"met, {-gap:.2f} s under it"


def _memory(cfg: RealShapeConfig, model_dir: str, workdir: Path, section: Section) -> Section:
    # Ours and the whole-batch HF forward (the full logits): each a fresh process of ~2 GB of weights.
    part = bench_memory.measure(cfg.memory, model_dir, workdir, impls=("ours", "hf_whole_batch"))
    for row in part.rows:
        section.rows.append(
            {"stage": "log-prob memory", "impl": row["impl"], "peak / full logits": row["peak / full logits"]}
        )
    section.ratios[MEMORY] = part.ratios.get("stage peak ours / full [B,T,V] float32 logits")
    section.ratios[MEMORY_TENSORS] = part.ratios.get(bench_memory.TENSOR_RATIO)
    m = cfg.memory
    section.notes.append(
        f"log-prob memory: full [B,T,V] float32 logits of B={m.batch}, T={m.seq_len}, V={m.shape.vocab_size} are "
        f"{m.logits_bytes(m.batch) / 2**20:.1f} MiB; one micro-batch's response logits "
        f"[{m.micro_batch}, {m.response_len}, V] are {m.micro_batch * m.response_len * m.shape.vocab_size * 4 / 2**20:.1f} MiB; "
        "stage peaks in MiB are in the memory part of extra.parts"
    )
    return part


def _row(stage: str, impl: str, row: dict[str, Any], seconds: str, tokens: str) -> dict[str, Any]:
    return {
        "stage": stage,
        "impl": impl,
        "seconds (best)": row.get(seconds),
        "tokens/s (best)": row.get(tokens),
        MFU_MODEL: row.get(MFU_MODEL),
        MFU_SPENT: row.get(MFU_SPENT),
    }


# ----------------------------------------------------------------------------- section


def run(cfg: RealShapeConfig, workdir: Path) -> Section:
    """Build the checkpoint once, run the four stages on it (each frees its models before the
    next), and gather one table; a stage that fails records its error and the rest still run."""
    model_dir, tokenizer = build_assets(workdir / "real_shape_model", cfg.shape)
    section = Section(
        name=NAME,
        title="At Qwen2.5-0.5B's shape: generation, update, GRPO step and log-prob memory vs their peers",
        columns=COLUMNS,
        config={
            "model": shape_text(cfg.shape),
            "params": cfg.shape.matmul_params,
            "generation": f"batch {cfg.generation.batch}, prompts {cfg.generation.prompt_len // 2}-"
            f"{cfg.generation.prompt_len}, {cfg.generation.new_tokens} new tokens"
            + _large_call_text(cfg.generation),
            "update": f"batch {cfg.update.batch} x {cfg.update.prompt_len}+{cfg.update.response_len}, micro-batch {cfg.update.micro_batch}",
            "GRPO": f"{cfg.grpo.prompts} prompts x {cfg.grpo.group}, {cfg.grpo.prompt_len}+{cfg.grpo.response_len}, micro-batch {cfg.grpo.micro_batch}",
            "memory": f"B={cfg.memory.batch}, T={cfg.memory.seq_len}, micro-batch {cfg.memory.micro_batch}",
            "threads": torch.get_num_threads(),
        },
        extra={"config": asdict(cfg), "parts": {}, "stage_seconds": {}},
    )
    stages = (
        ("generation", lambda: _generation(cfg, model_dir, tokenizer, section)),
        ("update", lambda: _update(cfg, model_dir, section)),
        ("grpo_step", lambda: _grpo(cfg, model_dir, tokenizer, workdir / "grpo", section)),
        ("memory", lambda: _memory(cfg, model_dir, workdir / "memory", section)),
    )
    for stage, fn in stages:
        start = time.perf_counter()
        try:
            part = fn()
        except Exception as exc:
            section.errors[stage] = error_text(exc)
            part = None
        section.extra["stage_seconds"][stage] = time.perf_counter() - start
        if isinstance(part, Section):
            section.errors.update({f"{stage}: {who}": err for who, err in part.errors.items()})
        section.extra["parts"][stage] = asdict(part) if isinstance(part, Section) else part
        gc.collect()  # the stage's models are garbage in reference cycles: free them for the next
    for key in RATIOS:
        section.ratios.setdefault(key, None)
    missed = [
        key for key in RATIOS if "not met" in target_text(section.ratios[key], TARGETS.get((NAME, key)))
    ]
    section.notes.insert(
        0,
        f"targets missed: {'; '.join(missed) if missed else 'none'}; each stage's note below says where its time goes",
    )
    section.notes.append(FLOPS_MODEL_SPENT_NOTE)
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
