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
then bypass, parity, off, ...), so a burst of load or a drift hits all alike; medians are over
every timed step of every round.

What each stage column covers: the trainer is handed its actor and rollout engine wrapped in
``TimedCalls`` (through the ``Components`` it is built from; nothing is set on either object),
which adds the CPU seconds of each of the trainer's calls of three methods to the step's stage:
``gen_cpu_s`` the rollout engine's ``generate_sequences`` (not the weight sync, wake-up and
parking around it, nor the prompts' padding and the replicas' gather in the trainer's ``gen``
stage); ``old_log_prob_cpu_s`` the actor's ``compute_log_prob`` of the old-log-prob stage (0 under
bypass, which calls it only for the probe: ``probe_cpu_s``); ``update_actor_cpu_s`` the actor's
``update_policy``. The trainer's own ``timing_s/*`` stages are wall time and wider, so they are
not used.

The section runs at 1 torch thread, whatever the headline thread count: at 2 threads the
process's CPU seconds count libgomp's idle worker spinning between ops (stage CPU ~2x its wall
time: the old run's 'off' step took 0.177 s wall, 0.345 s CPU), so they are as noisy as wall
time, and the update's 0.131 s (bypass) against 0.121 s (parity) in that run was that noise over
6 timed steps, not a cost: at 1 thread, 60 interleaved steps a side, the update took 0.0946 s
under bypass and 0.0940 s after the parity pass (same calls, no extra page faults).

Bypass keeps a parity probe (trainer/parity_probe.py): every ``rollout.parity_probe_interval``
steps (default 10) the actor recomputes one micro-batch per dp rank. The bench sets the interval
to the run's step count, so each bypass round probes at its last step; that step stays out of
the step median and the probe's CPU seconds are reported on their own (``probe_cpu_s``) and
charged to bypass at the default interval (probe / 10 per step) in the headline ratio.

What bypass can save is bounded by the share of the parity step that the old-log-prob pass
takes: the ratio ``bound`` is (parity step - its old_log_prob stage + probe / 10) / parity
step, the parity+bypass / parity ratio that skipping the pass and paying the probe, and nothing
else, would give. At the bench size generation dominates the step (64 decoded tokens per row
against one 96-token forward), so the bound is near 0.89, and the measured ratio sits at it: at 1
thread, one process per variant, 60 interleaved steps a side on a loaded machine, bypass 0.292 s
against parity 0.331 s CPU (0.884; bound 0.883). On a loaded machine a round can still land in a
burst of load (the stage medians of two variants then differ where the work is the same, e.g. gen).

Run alone: ``python benchmarks/bench_bypass.py [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from bench_grpo_step import QUICK as GRPO_QUICK
from bench_grpo_step import GRPOBenchConfig, _ours_config
from common import SMALL_SHAPE, Section, build_assets, error_text, ratio, run_alone, shape_text

FULL = GRPOBenchConfig(
    SMALL_SHAPE, prompts=4, group=4, prompt_len=32, response_len=64, micro_batch=8, steps=8, rounds=3
)
THREADS = 1
"""torch threads of this section (CPU seconds then count work, not an idle thread's spinning)"""
# bench_grpo_step's smoke sizes, each variant run once, two steps (bypass probes at the second).
QUICK = replace(GRPO_QUICK, steps=2, rounds=1)

VARIANTS = {"off": (False, False), "parity": (True, False), "parity+bypass": (True, True)}
STAGES = ("gen", "old_log_prob", "update_actor")
PROBE = "probe"
"""under bypass the actor's only log-prob pass is the parity probe's: timed under this name"""


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
    config.rollout.parity_probe_interval = cfg.total_steps  # one probe a bypass round, at its last step
    validate_config(config, 1)
    threads = torch.get_num_threads()
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    torch.set_num_threads(threads)
    steps: list[dict[str, Any]] = []
    try:
        config, components = build_components(config, runtime)
        stage_cpu: dict[str, float] = {}
        log_probs = PROBE if bypass else "old_log_prob"
        timed = replace(
            components,
            rollout=TimedCalls(components.rollout, {"generate_sequences": "gen"}, stage_cpu),
            actor=TimedCalls(
                components.actor, {"compute_log_prob": log_probs, "update_policy": "update_actor"}, stage_cpu
            ),
        )
        trainer = PPOTrainer(config, runtime, timed)
        for step in range(1, 1 + cfg.total_steps):
            stage_cpu.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(step)
            steps.append(
                {
                    "wall": time.perf_counter() - wall,
                    "cpu": time.process_time() - cpu,
                    **{stage: stage_cpu.get(stage, 0.0) for stage in (*STAGES, PROBE)},
                    "logprob_diff_max": metrics.get("rollout/logprob_diff/max"),
                }
            )
    finally:
        shutdown(runtime)
    return {"steps": steps[cfg.warmup :]}


class TimedCalls:
    """Stands in for ``inner`` (the actor, the rollout engine) where the trainer is handed it (its
    ``Components``): every attribute is ``inner``'s, and each call of a method named in ``stages``
    adds its ``clock`` seconds (CPU) to ``totals[stage]``. Nothing is set on ``inner``; only calls
    made through the stand-in are timed, which are all of the trainer's calls of these methods."""

    def __init__(
        self,
        inner: Any,
        stages: dict[str, str],
        totals: dict[str, float],
        clock: Callable[[], float] = time.process_time,
    ) -> None:
        self._inner, self._stages, self._totals, self._clock = inner, stages, totals, clock

    def __getattr__(self, name: str) -> Any:  # only for names the stand-in does not have itself
        value = getattr(self._inner, name)
        stage = self._stages.get(name)
        if stage is None:
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._clock()
            try:
                return value(*args, **kwargs)
            finally:
                self._totals[stage] = self._totals.get(stage, 0.0) + self._clock() - start

        return timed


def bypass_bound(
    parity_step: float | None, parity_old_log_prob: float | None, probe_per_step: float = 0.0
) -> float | None:
    """parity+bypass / parity if bypass saved exactly the parity step's old-log-prob stage and
    paid only its probe (``probe_per_step``: the probe's seconds over the probe interval)."""
    if parity_step is None or parity_old_log_prob is None:
        return None
    return ratio(parity_step - parity_old_log_prob + probe_per_step, parity_step)


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def variant_row(name: str, steps: list[dict]) -> dict:
    """A variant's table row: medians over its timed steps; a bypass probe step (``probe`` > 0)
    counts only in ``probe_cpu_s``, so the step and stage columns are those of a plain step."""
    plain = [s for s in steps if not s.get(PROBE)]
    row = {
        "variant": name,
        "step_s (median)": _median([s["wall"] for s in plain]),
        "step_cpu_s (median)": _median([s["cpu"] for s in plain]),
    }
    row.update({f"{stage}_cpu_s": _median([s[stage] for s in plain]) for stage in STAGES})
    row[f"{PROBE}_cpu_s"] = _median([s[PROBE] for s in steps if s.get(PROBE)])
    row["logprob diff max"] = steps[-1]["logprob_diff_max"]
    return row


def bypass_ratios(rows: dict[str, dict], interval: int) -> dict[str, float | None]:
    """The section's ratios from its rows (``interval``: the probe's default cadence, in steps)."""

    def of(variant: str, key: str) -> float | None:
        return rows[variant][key] if variant in rows else None

    parity_step, bypass_step = of("parity", "step_cpu_s (median)"), of("parity+bypass", "step_cpu_s (median)")
    probe = of("parity+bypass", f"{PROBE}_cpu_s")
    per_step = probe / interval if probe is not None else None
    return {
        f"step cpu, parity+bypass / parity (bypass saving, its probe every {interval} steps included)": ratio(
            None if bypass_step is None or per_step is None else bypass_step + per_step, parity_step
        ),
        f"bound: (parity step - its old_log_prob + probe / {interval}) / parity step": bypass_bound(
            parity_step, of("parity", "old_log_prob_cpu_s"), per_step or 0.0
        ),
        "step cpu, parity+bypass without its probe / parity": ratio(bypass_step, parity_step),
        "probe cpu / parity old_log_prob cpu": ratio(probe, of("parity", "old_log_prob_cpu_s")),
        "step wall, parity+bypass / parity": ratio(
            of("parity+bypass", "step_s (median)"), of("parity", "step_s (median)")
        ),
        "step cpu, parity / off": ratio(parity_step, of("off", "step_cpu_s (median)")),
        **{
            f"{stage} cpu, parity / off": ratio(of("parity", f"{stage}_cpu_s"), of("off", f"{stage}_cpu_s"))
            for stage in STAGES
        },
    }


def run(cfg: GRPOBenchConfig, workdir: Path) -> Section:
    """The three variants on one checkpoint, at ``THREADS`` torch threads (restored after); a
    failing variant is reported with its error text."""
    from verl_megatron.rollout.config import RolloutConfig

    model_dir, _ = build_assets(workdir / "bypass_model", cfg.shape, cfg.seed)
    section = Section(
        name="bypass",
        title="Bitwise parity and bypass: GRPO step, one process",
        columns=[
            "variant",
            "step_s (median)",
            "step_cpu_s (median)",
            *(f"{stage}_cpu_s" for stage in (*STAGES, PROBE)),
            "logprob diff max",
        ],
        config={
            **{k: v for k, v in asdict(cfg).items() if k != "shape"},
            "model": shape_text(cfg.shape),
            "threads": THREADS,
        },
    )
    raw: dict[str, dict] = {name: {"steps": []} for name in VARIANTS}
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for round_ in range(cfg.rounds):
            order = list(VARIANTS.items())  # ABC, CBA, ABC...: a drift over the run hits all alike
            for name, (parity, bypass) in order[:: -1 if round_ % 2 else 1]:
                if name in section.errors:
                    continue
                try:
                    out = run_variant(model_dir, cfg, workdir / f"bypass_{name}_{round_}", parity, bypass)
                except Exception as exc:
                    section.errors[name] = error_text(exc)
                    continue
                raw[name]["steps"].extend(out["steps"])
    finally:
        torch.set_num_threads(threads)
    section.rows = [
        variant_row(name, raw[name]["steps"])
        for name in VARIANTS
        if name not in section.errors and raw[name]["steps"]
    ]
    interval = RolloutConfig().parity_probe_interval
    section.ratios = bypass_ratios({r["variant"]: r for r in section.rows}, interval)
    section.notes.append(
        f"{THREADS} torch thread (CPU seconds are the work done; at 2 threads they count the idle worker's "
        "spinning too); stage columns are CPU seconds, medians over the timed steps of every round; bypass "
        "runs no old_log_prob stage (0) and probes at each round's last step: that step is left out of its "
        f"medians, probe_cpu_s is the probe's own median, charged at the default interval ({interval} steps) "
        "in the headline ratio and the bound; 'logprob diff max' is max |rollout_log_probs - old_log_probs| "
        "of the last step (none under bypass: nothing to compare)"
    )
    section.extra["raw"] = raw
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    main()
