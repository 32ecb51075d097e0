"""What bitwise parity costs and what bypass saves: one GRPO step, three ways, side by side.

- ``off``: the default (no batch-invariant kernels; old_log_probs recomputed);
- ``parity``: ``rollout.bitwise_parity=true`` (rollout log-probs equal old_log_probs bit for bit);
- ``parity+bypass``: also ``algorithm.rollout_correction.bypass_mode=true``, which skips the
  old-log-prob forward pass and trains on the rollout's log-probs.

Same checkpoint, prompts, seed and sizes for the three (configs/grpo.yaml with
bench_grpo_step's settings). Reported per variant: wall and CPU seconds per step and the CPU
seconds of its stages (generation, old-log-prob pass, actor update); ratios: step parity+bypass
/ parity (the saving), and parity / off per stage (the cost of the batch-invariant kernels).
CPU seconds are this process's, so they count every torch thread and are steadier than wall
time on a shared machine. The variants run ``rounds`` times, alternating (off, parity, bypass,
off, ...), so a burst of load hits all alike; medians are over every timed step of every round.

What bypass can save is bounded by the share of the parity step that the old-log-prob pass
takes: the ratio ``bound`` is (parity step - its old_log_prob stage) / parity step, the
parity+bypass / parity ratio that skipping the pass, and nothing else, would give. At the bench
size generation dominates the step (64 decoded tokens per row against one 96-token forward), so
the bound is near 0.9 and the measured ratio sits at it, within the machine's noise.

Run alone: ``python benchmarks/bench_bypass.py [--quick]``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from bench_grpo_step import QUICK as GRPO_QUICK
from bench_grpo_step import GRPOBenchConfig, _ours_config
from common import SMALL_SHAPE, Section, build_assets, error_text, ratio, run_alone, shape_text

FULL = GRPOBenchConfig(
    SMALL_SHAPE, prompts=4, group=4, prompt_len=32, response_len=64, micro_batch=8, steps=3, rounds=3
)
# bench_grpo_step's smoke sizes, each variant run once.
QUICK = replace(GRPO_QUICK, rounds=1)

VARIANTS = {"off": (False, False), "parity": (True, False), "parity+bypass": (True, True)}
STAGES = ("gen", "old_log_prob", "update_actor")


def run_variant(model_dir: str, cfg: GRPOBenchConfig, out_dir: Path, parity: bool, bypass: bool) -> dict:
    """``cfg.total_steps`` GRPO steps in this process: wall / CPU seconds and stage times per step."""
    from verl_megatron.distributed.parallel import init_runtime, shutdown
    from verl_megatron.trainer.components import build_components
    from verl_megatron.trainer.config import validate_config
    from verl_megatron.trainer.ppo_trainer import PPOTrainer

    out_dir.mkdir(parents=True, exist_ok=True)
    config = _ours_config(model_dir, cfg, out_dir)
    config.rollout.bitwise_parity = parity
    config.algorithm.rollout_correction.bypass_mode = bypass
    validate_config(config, 1)
    threads = torch.get_num_threads()
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    torch.set_num_threads(threads)
    steps: list[dict[str, Any]] = []
    try:
        config, components = build_components(config, runtime)
        trainer = PPOTrainer(config, runtime, components)
        stage_cpu: dict[str, float] = {}
        _time_cpu(trainer.rollout, "generate_sequences", "gen", stage_cpu)
        _time_cpu(trainer.actor, "compute_log_prob", "old_log_prob", stage_cpu)
        _time_cpu(trainer.actor, "update_policy", "update_actor", stage_cpu)
        for step in range(1, 1 + cfg.total_steps):
            stage_cpu.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(step)
            steps.append(
                {
                    "wall": time.perf_counter() - wall,
                    "cpu": time.process_time() - cpu,
                    **{stage: stage_cpu.get(stage, 0.0) for stage in STAGES},
                    "logprob_diff_max": metrics.get("rollout/logprob_diff/max"),
                }
            )
    finally:
        shutdown(runtime)
    return {"steps": steps[cfg.warmup :]}


def _time_cpu(owner: Any, method: str, stage: str, totals: dict[str, float]) -> None:
    """Wrap ``owner.method`` (on the instance) to add its CPU seconds to ``totals[stage]``."""
    inner = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[stage] = totals.get(stage, 0.0) + time.process_time() - start

    setattr(owner, method, timed)


def bypass_bound(parity_step: float | None, parity_old_log_prob: float | None) -> float | None:
    """parity+bypass / parity if bypass saved exactly the parity step's old-log-prob stage."""
    if parity_step is None or parity_old_log_prob is None:
        return None
    return ratio(parity_step - parity_old_log_prob, parity_step)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(cfg: GRPOBenchConfig, workdir: Path) -> Section:
    """The three variants on one checkpoint; a failing variant is reported with its error text."""
    model_dir, _ = build_assets(workdir / "bypass_model", cfg.shape, cfg.seed)
    section = Section(
        name="bypass",
        title="Bitwise parity and bypass: GRPO step, one process",
        columns=[
            "variant",
            "step_s (median)",
            "step_cpu_s (median)",
            *(f"{stage}_cpu_s" for stage in STAGES),
            "logprob diff max",
        ],
        config={
            **{k: v for k, v in asdict(cfg).items() if k != "shape"},
            "model": shape_text(cfg.shape),
            "threads": torch.get_num_threads(),
        },
    )
    raw: dict[str, dict] = {name: {"steps": []} for name in VARIANTS}
    for round_ in range(cfg.rounds):
        for name, (parity, bypass) in VARIANTS.items():
            if name in section.errors:
                continue
            try:
                out = run_variant(model_dir, cfg, workdir / f"bypass_{name}_{round_}", parity, bypass)
            except Exception as exc:
                section.errors[name] = error_text(exc)
                continue
            raw[name]["steps"].extend(out["steps"])
    for name in VARIANTS:
        steps = raw[name]["steps"]
        if name in section.errors or not steps:
            continue
        row = {
            "variant": name,
            "step_s (median)": _median([s["wall"] for s in steps]),
            "step_cpu_s (median)": _median([s["cpu"] for s in steps]),
        }
        row.update({f"{stage}_cpu_s": _median([s[stage] for s in steps]) for stage in STAGES})
        row["logprob diff max"] = steps[-1]["logprob_diff_max"]
        section.rows.append(row)
    rows = {r["variant"]: r for r in section.rows}

    def of(variant: str, key: str) -> float | None:
        return rows[variant][key] if variant in rows else None

    parity_step = of("parity", "step_cpu_s (median)")
    section.ratios = {
        "step cpu, parity+bypass / parity (bypass saving)": ratio(
            of("parity+bypass", "step_cpu_s (median)"), parity_step
        ),
        "bound: (parity step - its old_log_prob) / parity step": bypass_bound(
            parity_step, of("parity", "old_log_prob_cpu_s")
        ),
        "step wall, parity+bypass / parity": ratio(
            of("parity+bypass", "step_s (median)"), of("parity", "step_s (median)")
        ),
        "step cpu, parity / off": ratio(
            of("parity", "step_cpu_s (median)"), of("off", "step_cpu_s (median)")
        ),
        **{
            f"{stage} cpu, parity / off": ratio(of("parity", f"{stage}_cpu_s"), of("off", f"{stage}_cpu_s"))
            for stage in STAGES
        },
    }
    section.notes.append(
        "stage columns are CPU seconds (median over timed steps); bypass runs no old_log_prob "
        "stage (0); 'logprob diff max' is "
        "max |rollout_log_probs - old_log_probs| of the last step (none under bypass: nothing to compare)"
    )
    section.extra["raw"] = raw
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
