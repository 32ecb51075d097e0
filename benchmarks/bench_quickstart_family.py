"""A family quickstart learns: GRPO on the synthetic digit-reversal task from a random-init tiny model.

Runs ``configs/<config>`` (default ``quickstart_deepseek.yaml``: a tiny DeepSeek-V3 with multi-latent
attention, sigmoid routing with expert biases and a shared expert) as written, in this process, and
records the greedy validation reward per evaluation step, its start, the first evaluation step at
which it reaches ``--target`` (default 0.8) and its final value, with the command that produced it.
Steps, not seconds: the machine is shared and timings are noisy (the wall time is kept for scale).

    OMP_NUM_THREADS=1 python benchmarks/bench_quickstart_family.py
    python benchmarks/bench_quickstart_family.py --steps 2 --out /tmp/smoke.json   # smoke (not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAL_KEY = "val/test_score/synthetic/reverse"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quickstart_deepseek.yaml")
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer.total_training_steps (default: the recipe's)"
    )
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--val-key", default=VAL_KEY, help="the validation reward's metric")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "quickstart_deepseek.json")
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, ROOT)
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"trainer.default_local_dir={tmp}", "trainer.export_hf=false"]
        if args.steps is not None:
            overrides.append(f"trainer.total_training_steps={args.steps}")
        overrides += args.overrides
        start = time.perf_counter()
        run(os.path.join(ROOT, "configs", args.config), overrides)
        wall = time.perf_counter() - start
        rows = read_jsonl_metrics(os.path.join(tmp, "metrics.jsonl"))
    val = {int(r["step"]): round(r[args.val_key], 4) for r in rows if args.val_key in r}
    train = {int(r["step"]): round(r["critic/score/mean"], 4) for r in rows if "critic/score/mean" in r}
    reached = [s for s, v in sorted(val.items()) if v >= args.target]
    command = f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python benchmarks/bench_quickstart_family.py"
    command += "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    result = {
        "recipe": f"configs/{args.config}",
        "command": command,
        "steps": max(train) if train else 0,
        "val_start": val.get(0),
        f"first_step_val_ge_{args.target}": reached[0] if reached else None,
        "val_final": val[max(val)] if val else None,
        "val_reward": val,
        "train_reward": train,
        "wall_s": round(wall, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("val_reward", "train_reward")}))


if __name__ == "__main__":
    main()
