"""How our GRPO step time grows with response length and with batch size.

Two sweeps of the whole step (rollout + reward + log-probs + update) of our trainer on one tiny
model: response length 64 .. 1024 at a fixed batch, and batch size at a fixed response length.
Responses always run to full length (EOS ignored), so the token count is exact. For each sweep
the table gives the step time and its stages, and a least-squares fit of log(time) on log(size)
gives the exponent k in time ~ size^k: k near 1 is linear growth, k clearly above 1 is
super-linear (attention and KV-cache reads grow with length). A PNG plot (log-log) is saved.

Run alone: ``python benchmarks/bench_scaling.py [--quick]``.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from bench_grpo_step import GRPOBenchConfig, run_ours
from common import (
    HEADLINE_THREADS,
    QUICK_SHAPE,
    SMALL_SHAPE,
    Section,
    build_assets,
    error_text,
    fit_exponent,
    machine_info,
    shape_text,
)


@dataclass(frozen=True)
class ScalingBenchConfig:
    """The two sweeps of one GRPO step; batch = prompts x group sequences per step."""

    step: GRPOBenchConfig
    """the step measured at every point: its model, group, prompt length, micro-batch (at most the
    point's batch), warm-up and timed steps (the fastest counts: a shared machine's load comes in
    bursts) and seed; each point sets its own prompts and response length"""
    response_lens: tuple[int, ...] = (64, 128, 256, 512, 1024)
    """sweep 1: the response lengths, at ``batch_for_lengths`` sequences per step"""
    batch_for_lengths: int = 8
    batch_sizes: tuple[int, ...] = (4, 8, 16, 32)
    """sweep 2: the sequences per step, at ``response_len_for_batches`` response tokens"""
    response_len_for_batches: int = 128


FULL = ScalingBenchConfig(
    GRPOBenchConfig(SMALL_SHAPE, prompts=0, group=4, prompt_len=32, response_len=0, micro_batch=8, steps=2)
)
QUICK = ScalingBenchConfig(
    GRPOBenchConfig(QUICK_SHAPE, prompts=0, group=2, prompt_len=8, response_len=0, micro_batch=4, steps=1, warmup=0),
    response_lens=(8, 16), batch_for_lengths=4, batch_sizes=(2, 4), response_len_for_batches=8,
)  # fmt: skip


def _point(cfg: ScalingBenchConfig, batch: int, response_len: int) -> GRPOBenchConfig:
    step = cfg.step
    micro_batch = min(step.micro_batch, batch)
    return replace(step, prompts=batch // step.group, response_len=response_len, micro_batch=micro_batch)


def _sweep(
    kind: str,
    sizes: tuple[int, ...],
    points: list[GRPOBenchConfig],
    model: tuple[str, Any],
    workdir: Path,
    done: dict[tuple[int, int], dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One row per point: the timed step's seconds and its stages. ``done`` caches points by
    (batch, response_len): the sweeps cross at one point, which runs once."""
    rows, errors = [], {}
    for size, point in zip(sizes, points):
        key = (point.prompts * point.group, point.response_len)
        try:
            if key not in done:
                with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                    done[key] = run_ours(model[0], model[1], point, tmp)
        except Exception as exc:
            errors[f"{kind}={size}"] = error_text(exc)
            continue
        raw = done[key]
        timed = range(point.warmup, len(raw["step_seconds"]))
        best = min(timed, key=raw["step_seconds"].__getitem__)
        row = {"sweep": kind, "batch": key[0], "response_len": key[1], "step_s": raw["step_seconds"][best]}
        row.update({f"{stage}_s": s for stage, s in raw["stage_seconds"][best].items()})
        rows.append(row)
    return rows, errors


def _plot(rows_len: list[dict], rows_batch: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, rows, key, label in (
        (axes[0], rows_len, "response_len", "response length (tokens)"),
        (axes[1], rows_batch, "batch", "batch size (sequences)"),
    ):
        if not rows:
            ax.set_title(f"{label}: no data")
            continue
        xs = [r[key] for r in rows]
        # Stages under 2% of the slowest step would only clutter the plot (they stay in the table).
        floor = 0.02 * max(r["step_s"] for r in rows)
        columns = [c for c in rows[0] if c.endswith("_s") and max(r.get(c) or 0 for r in rows) >= floor]
        for col in columns:
            ax.plot(
                xs, [r.get(col) for r in rows], marker="o", lw=2.5 if col == "step_s" else 1.2, label=col[:-2]
            )
        # The linear reference through the first point: growth above it is super-linear.
        first = rows[0]["step_s"]
        ax.plot(xs, [first * x / xs[0] for x in xs], ls="--", color="gray", label="linear from first point")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per GRPO step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("verl-megatron GRPO step time (log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: ScalingBenchConfig, workdir: Path) -> Section:
    """Both sweeps, the fitted exponents per stage, and the plot (``extra['plot_png']``)."""
    step = cfg.step
    model = build_assets(workdir / "scaling_model", step.shape, step.seed)
    len_points = [_point(cfg, cfg.batch_for_lengths, n) for n in cfg.response_lens]
    batch_points = [_point(cfg, b, cfg.response_len_for_batches) for b in cfg.batch_sizes]
    done: dict[tuple[int, int], dict[str, Any]] = {}
    rows_len, err_len = _sweep("response_len", cfg.response_lens, len_points, model, workdir, done)
    rows_batch, err_batch = _sweep("batch", cfg.batch_sizes, batch_points, model, workdir, done)
    rows = rows_len + rows_batch
    stage_cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c.endswith("_s")]
    section = Section(
        name="scaling",
        title="GRPO step time vs response length and batch size (verl-megatron)",
        columns=["sweep", "response_len", "batch", *stage_cols],
        rows=rows,
        errors={**err_len, **err_batch},
        config={
            "model": shape_text(step.shape),
            "prompt_len": step.prompt_len,
            "group": step.group,
            "micro_batch": step.micro_batch,
            "threads": torch.get_num_threads(),
        },
    )
    exponents: dict[str, dict[str, float | None]] = {}
    for kind, sweep_rows, key in (("response_len", rows_len, "response_len"), ("batch", rows_batch, "batch")):
        for col in stage_cols:
            k = fit_exponent([r[key] for r in sweep_rows], [r.get(col) for r in sweep_rows])
            exponents.setdefault(kind, {})[col[:-2]] = k
        section.ratios[f"fitted exponent k, step time ~ {kind}^k"] = exponents[kind].get("step")
    for kind, per_stage in exponents.items():
        text = ", ".join(f"{stage} {k:.2f}" for stage, k in per_stage.items() if k is not None)
        section.notes.append(f"exponents vs {kind} per stage: {text or 'n/a'}")
    section.notes.append(
        f"each point: a fresh trainer, {step.warmup} warm-up step(s), then the fastest of {step.steps} timed steps; "
        "EOS ignored so every response is full length"
    )
    plot = workdir / "scaling.png"
    try:
        _plot(rows_len, rows_batch, plot)
        section.extra["plot_png"] = str(plot)
    except Exception as exc:
        section.errors["plot"] = error_text(exc)
    section.extra.update({"exponents": exponents, "config": asdict(cfg)})
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", default="scaling.png", help="where to copy the plot")
    args = parser.parse_args()
    torch.set_num_threads(HEADLINE_THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        section = run(QUICK if args.quick else FULL, Path(tmp))
        if "plot_png" in section.extra:
            Path(args.plot).write_bytes(Path(section.extra["plot_png"]).read_bytes())
    print(machine_info())
    print(section.to_markdown())


if __name__ == "__main__":
    main()
