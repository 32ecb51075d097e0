"""The agent quickstart learns: a short SFT on tool-use transcripts, then GRPO with the tool.

Runs the documented recipe, one stage after the other, on this machine (CPU, tiny model):

1. ``verl-megatron sft --config configs/sft_agent.yaml``: a deliberately short SFT on the lookup
   task's transcripts (user key -> tool call -> tool reply, masked -> answer), exported.
2. ``verl-megatron train --config configs/quickstart_agent.yaml model.path=<export>``: GRPO from
   that export, every conversation through the endpoint, the tool in the sandbox.

Reported: the SFT's validation loss curve, GRPO's greedy validation reward per evaluation step
(20 held-out keys; 1.0 = the right tool call and the right value), its start and the first
evaluation step at which it reaches ``--target`` (default 0.8). Steps, not seconds: the machine
is shared and timings are noisy.

    python benchmarks/bench_agent_learning.py                  # 80 GRPO steps, validation every 5
    python benchmarks/bench_agent_learning.py --steps 2 --quick  # smoke (not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAL_KEY = "val/test_score/agent/lookup"


def _stage(command: str, config: str, out_dir: str, overrides: list[str]) -> list[dict]:
    """``verl-megatron <command> --config configs/<config>`` in a subprocess; its metrics rows."""
    argv = [sys.executable, "-m", "verl_megatron.cli", command, "--config"]
    argv += [os.path.join(ROOT, "configs", config), f"trainer.default_local_dir={out_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(rows: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): round(float(r[key]), 4) for r in rows if key in r}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="GRPO steps from the SFT export")
    parser.add_argument("--sft-steps", type=int, default=None, help="default: configs/sft_agent.yaml's")
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny batches, numbers meaningless")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "agent_learning.json"))
    args = parser.parse_args(argv)
    small = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"] if args.quick else []
    sft_over = [f"trainer.total_training_steps={args.sft_steps}"] if args.sft_steps else []
    with tempfile.TemporaryDirectory(prefix="bench_agent_") as tmp:
        sft_dir = os.path.join(tmp, "sft")
        sft = _stage("sft", "sft_agent.yaml", sft_dir, sft_over + small)
        export = os.path.join(sft_dir, "hf_export")
        grpo_over = [f"model.path={export}", f"trainer.test_freq={args.test_freq}"]
        grpo_over.append(f"trainer.total_training_steps={args.steps}")
        grpo = _stage("train", "quickstart_agent.yaml", os.path.join(tmp, "grpo"), grpo_over + small)
    curve = _series(grpo, VAL_KEY)
    reached = next((step for step, value in sorted(curve.items()) if value >= args.target), None)
    result = {
        "task": "lookup (2-digit key, value from the `lookup` tool), 80 train / 20 validation keys",
        "recipe": ["configs/sft_agent.yaml", "configs/quickstart_agent.yaml model.path=<sft export>"],
        "sft_steps": max((int(r["step"]) for r in sft), default=0),
        "sft_val_loss": _series(sft, "val/loss"),
        "grpo_steps": args.steps,
        "val_reward": curve,
        "train_reward": _series(grpo, "critic/score/mean"),
        "start": curve.get(0),
        "target": args.target,
        "first_step_at_target": reached,
        "best": max(curve.values(), default=None),
        "quick": args.quick,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"validation reward {result['start']} at step 0 -> best {result['best']}; "
        f">= {args.target} first at step {reached} (of {args.steps}); written to {args.out}"
    )
    return result


if __name__ == "__main__":
    main()
