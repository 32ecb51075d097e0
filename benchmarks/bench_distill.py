"""On-policy distillation vs GRPO from the same random init, and GRPO from an SFT start.

Everything runs the quickstart's synthetic task (reverse 3 digits, tiny llama, CPU), one run
after the other on this machine:

1. ``sft``: ``configs/sft_quickstart.yaml`` trains the teacher (SFT on the task's correct answers)
   and exports it; its greedy validation reward is the target (``teacher``).
2. ``grpo``: ``configs/quickstart.yaml`` (GRPO) from the random init.
3. ``distill``: ``configs/distill_quickstart.yaml``: the same random init as student, the SFT
   export as frozen teacher, reverse-KL advantages only (no rule reward).
4. ``distill_gkd``: the same with ``algorithm.distill.loss=gkd_jsd`` (GKD's generalized JSD over
   the whole vocabulary as the loss, beta 0.5).
5. ``grpo_from_sft``: GRPO from the SFT export, to show that it starts above the random-init curve.

Reported: each run's validation curve (step -> mean greedy reward), the first validation step at
which the student reaches ``--fraction`` (default 0.9) of the teacher's reward, and the ratio of
those steps, distillation / GRPO (< 1: distillation gets there in fewer steps). Steps, not
seconds: the machine is shared and timings are noisy.

    python benchmarks/bench_distill.py                    # 100 steps each, validation every 5
    python benchmarks/bench_distill.py --steps 4 --quick  # smoke (not a measurement)
    python benchmarks/bench_distill.py --out FILE.json    # default benchmarks/results/distill.json
    python benchmarks/bench_distill.py --runs distill_gkd  # some runs only (the SFT teacher and
                                                           # grpo_from_sft always run): their curves
                                                           # replace those in an existing --out file
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("grpo", "distill", "distill_gkd")


def _train(config: str, out_dir: str, overrides: list[str], command: str = "train") -> list[dict]:
    """One run of ``verl-megatron <command>`` in a subprocess; its metrics rows."""
    argv = [sys.executable, "-m", "verl_megatron.cli", command, "--config", os.path.join(ROOT, "configs", config),
            f"trainer.default_local_dir={out_dir}", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _curve(rows: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if key in r}


def steps_to(curve: dict[int, float], target: float) -> int | None:
    """The first validation step whose value reaches ``target`` (None: never in the run)."""
    return next((step for step, value in sorted(curve.items()) if value >= target), None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=100, help="training steps of the GRPO and distillation runs"
    )
    parser.add_argument(
        "--from-sft-steps", type=int, default=20, help="training steps of GRPO from the SFT export"
    )
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.9, help="share of the teacher's reward to reach")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny batches, numbers meaningless")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "distill.json"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {RUNS}")
    args = parser.parse_args(argv)
    runs = args.runs.split(",")
    if not set(runs) <= set(RUNS):
        parser.error(f"--runs: {sorted(set(runs) - set(RUNS))} not among {RUNS}")
    key = "val/test_score/synthetic/reverse"
    small = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"] if args.quick else []
    rl = [f"trainer.total_training_steps={args.steps}", f"trainer.test_freq={args.test_freq}", *small]
    with tempfile.TemporaryDirectory() as tmp:
        sft_rows = _train("sft_quickstart.yaml", f"{tmp}/sft",
                          [f"trainer.total_training_steps={args.sft_steps}", *small], command="sft")  # fmt: skip
        teacher = f"{tmp}/sft/hf_export"
        # The teacher's greedy validation reward: step 0 of a GRPO run that starts from it.
        short = [
            f"trainer.total_training_steps={args.from_sft_steps}",
            f"trainer.test_freq={args.test_freq}",
            *small,
        ]
        from_sft = _train("quickstart.yaml", f"{tmp}/grpo_from_sft", [f"model.path={teacher}", *short])
        student = {"grpo": ("quickstart.yaml", []),
                   "distill": ("distill_quickstart.yaml", [f"algorithm.distill.teacher.model.path={teacher}"]),
                   "distill_gkd": ("distill_quickstart.yaml", [f"algorithm.distill.teacher.model.path={teacher}",
                                                               "algorithm.distill.loss=gkd_jsd"])}  # fmt: skip
        rows = {name: _train(student[name][0], f"{tmp}/{name}", [*student[name][1], *rl]) for name in runs}
    previous = {}
    if set(runs) != set(RUNS) and os.path.isfile(args.out):
        with open(args.out) as f:
            previous = json.load(f)
    curves = {
        **{k: {int(s): v for s, v in c.items()} for k, c in previous.get("curves", {}).items()},
        **{name: _curve(rows[name], key) for name in runs},
        "grpo_from_sft": _curve(from_sft, key),
    }
    teacher_reward = curves["grpo_from_sft"][0]
    target = args.fraction * teacher_reward
    reached = {name: steps_to(curve, target) for name, curve in curves.items() if name != "grpo_from_sft"}
    # GRPO that never gets there counts as the run's length (a lower bound on its steps).
    ratios = {
        f"ratio_steps_{name}_over_grpo": reached[name] / max(reached.get("grpo") or args.steps, 1)
        for name in ("distill", "distill_gkd")
        if reached.get(name) is not None
    }
    result = {
        **previous,
        "teacher_val_reward": teacher_reward,
        "target": target,
        "sft_val_loss": _curve(sft_rows, "val/loss"),
        "curves": curves,
        "steps_to_target": reached,
        **ratios,
        **{
            f"{'' if name == 'distill' else name + '_'}reverse_kl": _curve(rows[name], "distill/reverse_kl")
            for name in runs
            if name != "grpo"
        },
        **({"gkd_jsd": _curve(rows["distill_gkd"], "actor/gkd_jsd")} if "distill_gkd" in runs else {}),
        "settings": {**previous.get("settings", {}), **{f"runs {args.runs}": vars(args)}},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k in ("teacher_val_reward", "steps_to_target") or "ratio" in k
            }
        )
    )
    for name, curve in curves.items():
        print(name, " ".join(f"{s}:{v:.3f}" for s, v in sorted(curve.items())))
    return result


if __name__ == "__main__":
    main()
