"""Synchronous (colocated) vs asynchronous (separate, one-step off-policy) training on 2 processes.

Both modes run the quickstart task (configs/quickstart.yaml: GRPO, tiny llama, digit reversal)
under ``torchrun --nproc_per_node=2``, one after the other in the same run:

- ``sync``: today's default, both ranks generate their half of the batch, then both train (dp=2).
- ``async``: ``rollout.placement=separate rollout.world_size=1 async_training.max_staleness=1``
  with token-level TIS (``algorithm.rollout_correction.rollout_is=token``): rank 1 generates the
  batch of step s+1 while rank 0 trains step s (dp=1), weights sent after every update; with
  ``async_training.old_log_probs_on_rollout=true`` rank 1 also computes the old log-probs of the
  last rows of each batch when that step's weights arrive (where it would wait for them idle)
  while rank 0 computes the rows before: the same numbers up to float rounding. With
  ``actor.old_log_probs_from_first_update`` (in ``SHARED``, both modes) the first mini-batch's rows
  need no pass (their update forward gives them); rank 1 then computes every later row by default,
  and rank 0 does not wait for them before its update: it takes them when it cuts its second
  mini-batch (``timing_s/wait_old_log_probs``: how long it waited there).

Same cores in both modes: the machine's thread budget (``--threads``, 2 in a full run) is split
over the 2 processes, so every process runs ``budget // 2`` torch threads (1 on 2 cores) in both
modes: sync's two ranks each generate and train on one core, async's trainer trains on one core
while its rollout rank generates on the other. (Before, each process inherited the whole budget,
so async ran 4 busy threads on 2 cores while sync alternated.) Both modes run the same product
options (``SHARED``, listed in the section's config as ``options``): micro-batches grouped by
length under a budget of padded positions (``actor.group_by_length``), so a long-tailed batch
pads its short rows to their neighbours' length instead of the longest response's; before, a
micro-batch was a rank's whole share of a mini-batch padded to its longest row, which left the
one-process async trainer (all 512 rows) slower than sync's whole step.

Two parts:

1. throughput, on three workloads: the quickstart as shipped (4-token responses: training
   dominates a step), ``long`` (48-token responses, EOS ignored: every response the same
   length, so sync wastes nothing waiting for a straggler) and ``long-tail`` (EOS left to the
   policy, up to 128 tokens: the random-init policy stops at EOS with a small probability per
   token, so lengths are roughly geometric, most responses short and the longest of a batch of
   512 about 6x the mean; the table gives the mean and the longest per step, measured, not
   assumed). ``steps`` training steps without validation, ``repeats`` runs of each mode taken in
   turn; steps per minute from the trainer's step times (the first step, which pays start-up
   costs, is left out), the ratio the median over the repeats, and what each rank spent
   waiting per step: in sync mode a rank never waits for the other role, it does both in turn
   (generation and training time are given); in async mode the trainer waits for the rollout's
   batch (``timing_s/wait_rollout``) and the rollout for weights (``async/rollout_wait_weights_s``).
2. learning: the quickstart as shipped (150 steps, validation every 5), once per seed in
   ``seeds`` (``trainer.seed``: model, data and sampling) in each mode; the first step at which
   the mean validation reward reaches ``target`` (0.8, the quickstart's promise), per seed and
   its median per mode (one seed's curve moves the first crossing by tens of steps).
   Minutes on 2 CPU cores; ``--quick`` and ``benchmarks/run.py --quick`` skip it.

   What one step of staleness costs here (``--learning-only --seeds 1,...,12`` on 5c1f4b4, Dec 6,
   loaded 2-core machine, 22-35 s a run): steps to 0.8 on seeds 1..12, sync 80 90 90 95 100 85 95 80 90 90 85 95
   (median 90), async 100 130 100 105 120 85 95 115 100 85 95 110 (median 100): ratio 1.11; per
   seed async - sync +20 +40 +10 +10 +20 0 0 +35 +10 -5 +10 +15 (median +10, mean +14, sd 14).
   The first full run with 12 seeds (4259a0e, on f6ccb88: later code, the same options) gave sync
   75 90 85 90 105 90 105 85 85 85 80 90 (median 87.5), async 95 135 95 115 120 80 120 110 110 95
   90 115 (median 110): ratio 1.26, per seed +20 +45 +10 +25 +15 -10 +15 +25 +25 +10 +10 +25
   (median +17.5). Changes since (e.g. stopping on the model's whole EOS list) draw other samples
   from the same seeds; with a per-seed spread of 14 steps a 12-seed median moves by about 5
   steps, so the two runs differ by about what chance allows, and both miss the 1.1 target.
   The correction is not what is lost: the IS weights (old / behaviour log-probs, token TIS at 2)
   average 0.99 over the async steps of the 12 runs, with an effective sample size of 0.97 of the
   batch in the median step and 0.92 at the 5th percentile, and the old log-probs computed on the
   rollout rank or on the trainer give the same run (seed 2: step 130 and the same last reward).
   What costs is the lag itself, which grows as the policy sharpens (``rollout_corr/kl`` 0.007 over
   steps 1-30, 0.04-0.08 over steps 61-150), and the seed noise is as large: the same separate
   placement at ``max_staleness=0`` (on-policy, the async run's sampling streams) gives 80 145 90
   90 120 80 on seeds 1-6. No other correction did better on seeds 1-6 (None: 0.8 not reached in
   150 steps): sequence IS 90 115 110 None 135 85, token TIS at 5 100 110 100 None 115 None,
   IcePop [0.5, 5] 105 None 90 None 140 90, token TIS at 1.5 130 None 125 None 125 80; so the
   async mode keeps token TIS at 2 (verl's ``decoupled_token_is``). ``seeds`` is these 12 (about
   32 s a run in the full run of 4259a0e, 13 minutes for both modes): a 3-seed ratio of medians resampled from them
   spans 1.00-1.33 (5-95%), so 3 seeds, as before, could not tell 1.1 from 1.2.

   Would less lag do? A temporary patch (not kept) made sync's ranks generate each batch with the
   weights of L optimizer steps before the ones that train it (token TIS at 2, as async). Seeds
   1-12: L=0 75 95 85 95 105 85 95 85 85 85 80 95 (median 90, mean 88.8), L=1 85 100 100 100 125
   105 90 120 100 100 90 100 (median 100, mean 101.3); seeds 1-6: L=2 95 100 100 110 120 115
   (median 105), L=1 without a correction 85 90 105 125 125 100 (median 102.5). L=2 is the async
   mode's lag (its first mini-batch trains on weights two optimizer steps newer than the batch was
   sampled with). One step of lag costs about what two do, with or without the correction,
   although ``rollout_corr/kl`` falls 4x (0.009 vs 0.038 nats a token, run means): so weights sent
   after the first mini-batch (lag 1) would not close the gap, and a generation that overlaps
   training lags at least one optimizer step.

    python benchmarks/bench_async.py                  # both parts
    python benchmarks/bench_async.py --quick          # throughput only, 4 steps (smoke)
    python benchmarks/bench_async.py --no-learning    # throughput only
    python benchmarks/bench_async.py --learning-only --seeds 1,2,3,4,5,6
                                                      # learning only, these seeds
    python benchmarks/bench_async.py --out FILE.json  # default benchmarks/results/async.json
    python benchmarks/bench_async.py --no-learning --workloads long-tail --options ""
                                                      # one workload, product defaults (before)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, Section, child_env, machine_info, ratio

QUICKSTART = REPO_ROOT / "configs" / "quickstart.yaml"
MODES = {
    "sync": [],
    "async": [
        "rollout.placement=separate",
        "rollout.world_size=1",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "async_training.old_log_probs_on_rollout=true",
    ],
}
VAL_KEY = "val/test_score/synthetic/reverse"
WORKLOADS = {
    "quickstart": [],
    "long": ["data.max_response_length=48", "rollout.ignore_eos=true"],
    # EOS where the policy samples it, capped at 128 tokens: lengths as the model makes them.
    "long-tail": ["data.max_response_length=128"],
}
PROCESSES = 2
# Product options both modes run with (stated in the section's config): rows grouped by length
# into micro-batches of at most 2048 padded positions (rows x longest row), for the update and the
# old log-probs alike, so a long-tailed batch does not pad every short row to its longest
# (workers/batching.length_grouped_partition). On a 512-row long-tailed batch this cuts the
# trainer's CPU time 3.5x at dp=1 and 2.7x per rank at dp=2 (the quickstart's 10-token rows are
# one or two micro-batches, as before). The first of the two mini-batches takes its old log-probs
# from its own update forward (actor.old_log_probs_from_first_update), so the old-log-prob pass
# covers half the rows in both modes: sync's ranks compute 128 rows each instead of 256; async's
# rollout rank all 256, while the trainer's first mini-batch trains (before: 128 rows on each side,
# the trainer waiting for the rollout's before its update).
SHARED = [
    "actor.use_dynamic_bsz=true",
    "actor.group_by_length=true",
    "actor.ppo_max_token_len_per_gpu=2048",
    "actor.ppo_infer_max_token_len_per_gpu=2048",
    "actor.old_log_probs_from_first_update=true",
]


@dataclass(frozen=True)
class AsyncBenchConfig:
    """Sizes of the benchmarked runs."""

    steps: int = 12
    repeats: int = 3
    """Throughput runs of each mode per workload, the modes alternating (sync, async, async, sync,
    ...). One run's mean step moves a lot between runs of the same code on a quiet machine: on the
    long tail, sync 0.43-0.64 s over 13 runs within an hour, async 0.36-0.41 s over 7 (the same
    sampled lengths each time; pinning each rank to its own core did not narrow sync's spread), so
    one run of each mode gave ratios from 1.14 to 1.67. Each row is the mode's median run and the
    ratio the median of the ratios of the runs made one after the other."""
    learning: bool = True
    learning_steps: int = 150
    test_freq: int = 5
    seeds: tuple[int, ...] = tuple(range(1, 13))
    """``trainer.seed`` of the learning runs (1: the quickstart's own), the same in both modes
    (why 12: the module docstring)."""
    target: float = 0.8
    timeout_s: int = 3600
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    options: tuple[str, ...] = tuple(SHARED)
    """Product options both modes run with."""


FULL = AsyncBenchConfig()
QUICK = AsyncBenchConfig(steps=4, repeats=1, learning=False, timeout_s=600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_process(budget: int, processes: int = PROCESSES) -> int:
    """Torch threads each process of a run gets: the budget split evenly, at least one."""
    return max(1, budget // processes)


def run_env(budget: int) -> dict[str, str]:
    """The environment of a run's processes: ``threads_per_process(budget)`` threads each."""
    return {**child_env(), "OMP_NUM_THREADS": str(threads_per_process(budget))}


def train(
    mode: str, overrides: list[str], out_dir: Path, timeout_s: int, options: tuple[str, ...] = tuple(SHARED)
) -> list[dict[str, Any]]:
    """One 2-process quickstart run in ``mode`` with the product ``options``; its metrics rows."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}",
        f"--master_port={_free_port()}",
        "-m", "verl_megatron.train", "--config", str(QUICKSTART), *options, *MODES[mode],
        f"trainer.default_local_dir={out_dir}", "trainer.export_hf=false", "trainer.logger=[jsonl]",
        *overrides,
    ]  # fmt: skip
    env = run_env(torch.get_num_threads())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT, env=env)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        raise RuntimeError(f"{mode} run exited with {proc.returncode}: {(errors or [output[-600:]])[0]}")
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def throughput_row(workload: str, mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps per minute and per-step times of one run's steps 2..N."""
    steps = [r for r in rows if r.get("step", 0) >= 2 and "timing_s/step" in r]
    step_s = _mean(steps, "timing_s/step")
    row: dict[str, Any] = {
        "run": f"{workload} {mode}",
        "steps/min": 60.0 / step_s if step_s else None,
        "step_s": step_s,
        "trainer: gen_s": _mean(steps, "timing_s/gen"),
        "trainer: old_log_prob_s": _mean(steps, "timing_s/old_log_prob"),
        "trainer: update_actor_s": _mean(steps, "timing_s/update_actor"),
        "trainer: waits in it for old log-probs_s": _mean(steps, "timing_s/wait_old_log_probs"),
        "trainer: waits for batch_s": _mean(steps, "timing_s/wait_rollout") if mode == "async" else 0.0,
        "rollout rank: gen_s": _mean(steps, "async/rollout_gen_s"),
        "rollout rank: waits for weights_s": _mean(steps, "async/rollout_wait_weights_s"),
        "rollout rank: old_log_prob_s": _mean(steps, "async/rollout_old_log_prob_s"),
        "rollout rank: reward_s": _mean(steps, "async/rollout_reward_s"),
        "staleness (mean)": _mean(steps, "async/staleness_mean") if mode == "async" else 0.0,
        "response length (mean)": _mean(steps, "response_length/mean"),
        "response length (max)": _mean(steps, "response_length/max"),
    }
    return row


def run_order(repeats: int) -> list[tuple[str, ...]]:
    """The order of the modes in each repeat: sync first, then async first, and so on, so that a
    machine drifting faster or slower over the runs does not favour one mode."""
    modes = tuple(MODES)
    return [modes if r % 2 == 0 else modes[::-1] for r in range(repeats)]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median steps/min (the lower of the middle two for an even count): a real
    run's row, so its columns stay consistent with each other."""
    ranked = sorted(runs, key=lambda r: r["steps/min"] if r["steps/min"] is not None else -math.inf)
    return ranked[(len(ranked) - 1) // 2]


def paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """async / sync steps/min of the runs of each repeat (made one after the other)."""
    return [ratio(a["steps/min"], s["steps/min"]) for s, a in zip(runs["sync"], runs["async"], strict=True)]


def median_or_none(values: list[float | None]) -> float | None:
    """The median, or None when any value is missing (a run without step times)."""
    return None if not values or None in values else statistics.median(values)


def _repeats_note(workload: str, runs: dict[str, list[dict[str, Any]]], pairs: list[float | None]) -> str:
    def spread(mode: str) -> str:
        values = [r["steps/min"] for r in runs[mode] if r["steps/min"] is not None]
        return f"{min(values):.1f}-{max(values):.1f}" if values else "n/a"

    shown = ", ".join("n/a" if p is None else f"{p:.3f}" for p in pairs)
    return (
        f"{workload}: {len(pairs)} runs of each mode, alternating; steps/min sync {spread('sync')}, "
        f"async {spread('async')}; async / sync of each repeat {shown} (the ratio: their median; "
        "the rows: each mode's median run)"
    )


def _ceiling_note(workload: str, by_mode: dict[str, dict[str, Any]]) -> str:
    """What bounds async on ``workload``: the busier of its two roles, the trainer (its step less
    the wait for the batch) and the rollout rank (its generation of the whole batch on one
    process, its share of the old log-probs and the rewards it scores); async's step can be no
    shorter, however well the two overlap. Moving work from one role to the other (e.g.
    ``async_training.old_log_probs_rollout_share``) can at best make both equally busy: their
    mean busy time bounds every such split."""
    sync, asyn = by_mode["sync"], by_mode["async"]
    if sync["step_s"] is None or asyn["step_s"] is None:
        return f"{workload}: no step times"
    waits = (asyn[f"trainer: {k}_s"] or 0.0 for k in ("waits for batch", "waits in it for old log-probs"))
    busy = asyn["step_s"] - sum(waits)
    rollout_busy = sum(asyn[f"rollout rank: {k}_s"] or 0.0 for k in ("gen", "old_log_prob", "reward"))
    bound, balanced = max(busy, rollout_busy), (busy + rollout_busy) / 2
    return (
        f"{workload}: the async trainer is busy {busy:.3f} s a step (old-log-prob stage "
        f"{asyn['trainer: old_log_prob_s'] or 0.0:.3f} s, + update "
        f"{asyn['trainer: update_actor_s'] or 0.0:.3f} s of the whole batch on one process, of which "
        f"{asyn['trainer: waits in it for old log-probs_s'] or 0.0:.3f} s waiting for the rollout's), its rollout rank "
        f"generates for {asyn['rollout rank: gen_s'] or 0.0:.3f} s, computes old log-probs for "
        f"{asyn['rollout rank: old_log_prob_s'] or 0.0:.3f} s, scores rewards for "
        f"{asyn['rollout rank: reward_s'] or 0.0:.3f} s and waits {asyn['rollout rank: waits for weights_s'] or 0.0:.3f} s for weights; sync's step is "
        f"{sync['step_s']:.3f} s, of which generation {sync['trainer: gen_s'] or 0.0:.3f} s: async cannot exceed "
        f"{sync['step_s'] / bound:.2f}x here however its generation overlaps, and no split of this work "
        f"between the two roles beyond {sync['step_s'] / balanced:.2f}x (both equally busy)"
    )


def steps_to_target(rows: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    """(first step whose validation reward is >= target, the last validation reward)."""
    val = [(r["step"], r[VAL_KEY]) for r in rows if VAL_KEY in r]
    reached = next((step for step, score in val if score >= target), None)
    return reached, (val[-1][1] if val else None)


def median_steps(reached: list[int | None]) -> float | None:
    """Median first step at the target over the seeds, a seed that never reached it counting as
    later than all that did; None when the median is such a seed (or there are none)."""
    if not reached:
        return None
    median = statistics.median(math.inf if r is None else r for r in reached)
    return None if math.isinf(median) else float(median)


def _learning(config: AsyncBenchConfig, tmp: Path, section: Section) -> None:
    """The learning runs (every seed in both modes); steps to the target per seed, and the ratio of
    the modes' medians."""
    learn = [f"trainer.total_training_steps={config.learning_steps}", f"trainer.test_freq={config.test_freq}"]
    median = {}
    for mode in MODES:
        runs = {}
        for seed in config.seeds:
            out = tmp / f"learn_{mode}_{seed}"
            start = time.perf_counter()
            rows = train(mode, [*learn, f"trainer.seed={seed}"], out, config.timeout_s, config.options)
            wall_s = round(time.perf_counter() - start, 1)
            reached, last = steps_to_target(rows, config.target)
            curve = [(r["step"], round(r[VAL_KEY], 4)) for r in rows if VAL_KEY in r]
            runs[seed] = {
                "steps_to_target": reached,
                "last_val_reward": last,
                "val_curve": curve,
                "wall_s": wall_s,
            }
        median[mode] = median_steps([r["steps_to_target"] for r in runs.values()])
        section.extra[f"learning_{mode}"] = {"median_steps_to_target": median[mode], "seeds": runs}
        per_seed = ", ".join(
            f"seed {seed}: step {r['steps_to_target']} ({r['last_val_reward']:.3f} at step {config.learning_steps})"
            for seed, r in runs.items()
        )
        section.notes.append(
            f"learning, {mode}: validation reward >= {config.target} first at (checked every "
            f"{config.test_freq}) {per_seed}; median {median[mode]}"
        )
    section.ratios["steps to target async / sync"] = ratio(median["async"], median["sync"])


def run(config: AsyncBenchConfig, workdir: Path) -> Section:
    workdir.mkdir(parents=True, exist_ok=True)
    columns = list(throughput_row("", "sync", []).keys())
    section = Section(
        name="async",
        title="Sync (colocated) vs async (separate, one-step off-policy) training, 2 processes",
        columns=columns,
        config={**asdict(config), "threads per process": threads_per_process(torch.get_num_threads())},
    )
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        plain = [
            f"trainer.total_training_steps={config.steps}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        ]
        for workload in config.workloads:
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for repeat, order in enumerate(run_order(config.repeats)):
                for mode in order:
                    out_dir = Path(tmp) / f"{workload}_{mode}_{repeat}"
                    rows = train(
                        mode, [*plain, *WORKLOADS[workload]], out_dir, config.timeout_s, config.options
                    )
                    runs[mode].append(throughput_row(workload, mode, rows))
            by_mode, pairs = {mode: median_run(runs[mode]) for mode in MODES}, paired_ratios(runs)
            section.rows.extend(by_mode.values())
            section.ratios[f"steps/min async / sync ({workload})"] = median_or_none(pairs)
            if config.repeats > 1:
                section.notes.append(_repeats_note(workload, runs, pairs))
            section.notes.append(_ceiling_note(workload, by_mode))
        if config.learning:
            _learning(config, Path(tmp), section)
        else:
            section.notes.append(
                "learning comparison skipped (--quick / --no-learning); run `python benchmarks/bench_async.py`"
            )
    section.notes.append(
        "sync: both ranks generate then both train (dp=2), nobody waits for another role; async: rank 0 "
        "trains (dp=1) while rank 1 generates the next batch and computes the old log-probs of the rows "
        "after the first mini-batch of the batch rank 0 trains (the first one's update forward gives its "
        "own, in both modes), which rank 0's update takes when it reaches them; every process runs "
        f"{threads_per_process(torch.get_num_threads())} torch thread(s) in both modes"
    )
    return section


def run_section(quick: bool, workdir: Path) -> Section:
    """benchmarks/run.py's entry: skipped in --quick (two torchrun jobs cost more than a quick run)."""
    if quick:
        return Section(
            name="async",
            title="Sync vs async training (skipped in --quick)",
            columns=[],
            notes=[
                "skipped in --quick mode; run `python benchmarks/bench_async.py --quick` for its smoke test"
            ],
        )
    return run(FULL, workdir)


def config_from_args(args: argparse.Namespace) -> AsyncBenchConfig:
    """The run's sizes from the command line (``--learning-only``: no throughput workload)."""
    config = QUICK if args.quick else FULL
    if args.no_learning:
        config = dataclasses.replace(config, learning=False)
    if args.seeds is not None:
        config = dataclasses.replace(config, seeds=tuple(int(s) for s in args.seeds.split(",") if s))
    workloads = () if args.learning_only else tuple(w for w in args.workloads.split(",") if w)
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    config = dataclasses.replace(config, workloads=workloads, learning=config.learning or args.learning_only)
    if args.options is not None:
        config = dataclasses.replace(config, options=tuple(args.options.split()))
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        config = dataclasses.replace(config, repeats=args.repeats)
    return config


def parser() -> argparse.ArgumentParser:
    """The command line (``config_from_args`` reads what it parses)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="throughput only, a few steps")
    parts = parser.add_mutually_exclusive_group()
    parts.add_argument("--no-learning", action="store_true", help="throughput part only")
    parts.add_argument("--learning-only", action="store_true", help="learning part only (no throughput)")
    parser.add_argument(
        "--seeds",
        default=None,
        help=f"comma-separated trainer.seed values of the learning runs (default: {FULL.seeds})",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset of the workloads"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help=f"throughput runs of each mode (default: {FULL.repeats})"
    )
    parser.add_argument(
        "--options",
        default=None,
        help=f"product options of both modes, space-separated (default: {' '.join(SHARED)})",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "async.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        cli.error(str(e))
    section = run(config, Path(args.out).parent / "async_work")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(section.to_json(machine_info()), indent=2, default=str) + "\n")
    print(section.to_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
