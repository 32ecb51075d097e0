"""Data-parallel scaling: our GRPO step on 1 and on 2 processes (dp=2), same global batch.

Each point is a fresh ``torchrun`` job on this machine running ``bench_grpo_step.run_ours``
(rollout, reward, old log-probs, advantages, update; gloo on CPU) for the warm-up and timed
steps; rank 0 reports the step times (``--quick`` runs dp=1 in the harness's own process).
The machine's thread budget (``--threads``, 2 in the headline run) is split over the
processes, so both points use the same cores: dp=2 runs two
processes of threads / 2 threads each. Reported: step time, tokens per second in total and per
process (tokens = prompts x group x (prompt_len + response_len); responses always run to full
length), and the scaling efficiency (total tokens/s at dp=2 over dp=1).

Run alone: ``python benchmarks/bench_dp_scaling.py [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_grpo_step as grpo
import torch
from common import (
    HEADLINE_THREADS,
    ModelShape,
    Section,
    build_assets,
    child_env,
    error_text,
    ratio,
    shape_text,
)


@dataclass(frozen=True)
class DPScalingConfig:
    """The GRPO step measured and the process counts it runs on."""

    grpo: grpo.GRPOBenchConfig
    world_sizes: tuple[int, ...] = (1, 2)
    single_in_process: bool = False
    """dp=1 in this process instead of a torchrun job of its own: the smoke run's saving (a job's
    start-up is ~10 CPU s, more than its step); the full run keeps every point a fresh job"""


FULL = DPScalingConfig(grpo=grpo.FULL)
QUICK = DPScalingConfig(grpo=dataclasses.replace(grpo.QUICK, prompts=2, group=2), single_in_process=True)


def _tokens_per_step(cfg: grpo.GRPOBenchConfig) -> int:
    return cfg.prompts * cfg.group * (cfg.prompt_len + cfg.response_len)


def _launch(world: int, threads: int, model_dir: str, cfg_file: Path, out: Path, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += [__file__, "--child", "--model-dir", model_dir, "--cfg", str(cfg_file), "--json", str(out)]
    env = child_env()
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=workdir)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-3:]
        raise RuntimeError(f"dp={world} exited with {proc.returncode}: {' | '.join(tail)}")
    return json.loads(out.read_text())


def _in_process(model_dir: str, cfg: grpo.GRPOBenchConfig, workdir: Path) -> dict:
    """The dp=1 point in this process, on all of its threads (a one-process job's budget)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        return grpo.run_ours(model_dir, None, cfg, tmp, world_size=1)


def run(cfg: DPScalingConfig, workdir: Path) -> Section:
    """One torchrun job per world size (in --quick, dp=1 runs in this process: a smoke run checks
    the harness, and its ratio does not compare like with like); a failed point records its error."""
    g = cfg.grpo
    model_dir, _ = build_assets(workdir / "dp_model", g.shape, g.seed)
    cfg_file = workdir / "dp_cfg.json"
    cfg_file.write_text(json.dumps(asdict(g)))
    budget = torch.get_num_threads()
    tokens = _tokens_per_step(g)
    section = Section(
        name="dp_scaling",
        title="Data-parallel scaling: our GRPO step on 1 vs 2 processes (same cores, same global batch)",
        columns=[
            "processes (dp)",
            "threads / process",
            "step_s (best)",
            "step_s (median)",
            "tokens/s",
            "tokens/s per process",
            "gen",
            "old_log_prob",
            "update_actor",
        ],
        config={
            "model": shape_text(g.shape),
            "prompts x group": f"{g.prompts} x {g.group}",
            "prompt_len": g.prompt_len,
            "response_len": g.response_len,
            "micro_batch": g.micro_batch,
            "thread budget": budget,
        },
    )
    by_world: dict[int, dict[str, Any]] = {}
    for world in cfg.world_sizes:
        threads = max(1, budget // world)
        try:
            if world == 1 and cfg.single_in_process:
                raw = _in_process(model_dir, g, workdir)
            else:
                raw = _launch(world, threads, model_dir, cfg_file, workdir / f"dp{world}.json", workdir)
        except Exception as exc:
            section.errors[f"dp={world}"] = error_text(exc)
            continue
        row = grpo._row(f"dp={world}", raw, g.warmup)
        tps = tokens / row["step_s (best)"]
        by_world[world] = {
            "processes (dp)": world,
            "threads / process": threads,
            "step_s (best)": row["step_s (best)"],
            "step_s (median)": row["step_s (median)"],
            "tokens/s": tps,
            "tokens/s per process": tps / world,
            **{k: row.get(k) for k in ("gen", "old_log_prob", "update_actor")},
        }
        section.rows.append(by_world[world])
        section.extra[f"raw_dp{world}"] = raw
    if 1 in by_world and 2 in by_world:
        section.ratios["tokens/s dp=2 / dp=1 (same cores)"] = ratio(
            by_world[2]["tokens/s"], by_world[1]["tokens/s"]
        )
        section.ratios["tokens/s per process dp=2 / dp=1"] = ratio(
            by_world[2]["tokens/s per process"], by_world[1]["tokens/s per process"]
        )
    section.notes.append(
        f"tokens per step = prompts x group x (prompt_len + response_len) = {tokens}; stage columns are rank 0's "
        "timing_s/*; the thread budget is split over the processes, so an efficiency of 1.0 means dp costs "
        "nothing beyond the cores it uses"
    )
    section.extra["config"] = asdict(cfg)
    return section


def _child(model_dir: str, cfg_file: str, out: str) -> None:
    raw = json.loads(Path(cfg_file).read_text())
    cfg = grpo.GRPOBenchConfig(**{**raw, "shape": ModelShape(**raw["shape"])})
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory() as tmp:
        result = grpo.run_ours(model_dir, None, cfg, tmp, world_size=world)
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cfg", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.model_dir, args.cfg, args.json)
        return
    torch.set_num_threads(HEADLINE_THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        section = run(QUICK if args.quick else FULL, Path(tmp))
    print(section.to_markdown())


if __name__ == "__main__":
    main()
