"""Reward scoring throughput: sequential vs process-pool reward managers.

Scores GSM8K-style responses (``#### answer``, a regex: microseconds per
sample) and MATH-style boxed answers (math-verify: about a millisecond) with
the default scorer and reports samples/s per manager, as a markdown table
and as JSON. Built-in scorers run in-process by default; a user's scorer file
runs in an isolated worker process (the second row: same scorer, isolated)::

    python benchmarks/bench_reward.py                 # 1,000 samples per workload
    python benchmarks/bench_reward.py --quick         # smoke test: 100 samples, 1 repeat
    python benchmarks/bench_reward.py --out results.json

Every manager must produce the same reward tensor as the sequential one;
the run fails otherwise. Worker start-up is excluded (one warm-up call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.reward.managers import NaiveRewardManager, ParallelRewardManager
from verl_megatron.utils.local_assets import build_char_tokenizer

PROMPT_LEN, RESPONSE_LEN = 32, 96


def gsm8k_sample(rng: random.Random) -> tuple[str, str, str]:
    """An addition word problem with a worked answer; about half are right."""
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    answer = a + b if rng.random() < 0.5 else a + b + rng.randint(1, 9)
    prompt = f"Tom has {a} apples, gets {b}. Total?"
    return prompt, f"He has {a} + {b} = {answer} apples in all.\n#### {answer:,}", str(a + b)


def math_sample(rng: random.Random) -> tuple[str, str, str]:
    """A fraction answer in a box, sometimes written as a decimal; about half are right."""
    num, den = rng.randint(1, 9), rng.choice([2, 4, 5, 8])
    shown = num if rng.random() < 0.5 else num + 1
    answer = f"\\frac{{{shown}}}{{{den}}}" if rng.random() < 0.5 else f"{shown / den:g}"
    return f"What is {num}/{den}?", f"Dividing, we get $\\boxed{{{answer}}}$.", f"\\frac{{{num}}}{{{den}}}"


WORKLOADS = {
    "gsm8k": ("openai/gsm8k", gsm8k_sample),
    "math (math-verify)": ("HuggingFaceH4/MATH-500", math_sample),
}


def make_batch(tokenizer, data_source: str, make_sample, num_samples: int, seed: int = 0) -> DataProto:
    """Left-padded prompts, right-padded responses, one data source."""
    rng = random.Random(seed)
    prompts = torch.full((num_samples, PROMPT_LEN), tokenizer.pad_token_id, dtype=torch.long)
    responses = torch.full((num_samples, RESPONSE_LEN), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(num_samples, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    truths = []
    for i in range(num_samples):
        prompt, response, truth = make_sample(rng)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-PROMPT_LEN:]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"][:RESPONSE_LEN]
        prompts[i, PROMPT_LEN - len(p_ids) :] = torch.tensor(p_ids)
        responses[i, : len(r_ids)] = torch.tensor(r_ids)
        mask[i, PROMPT_LEN - len(p_ids) : PROMPT_LEN + len(r_ids)] = 1
        truths.append(truth)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={
            "data_source": np.array([data_source] * num_samples, dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object),
        },
    )


def time_manager(manager, data: DataProto, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds per full-batch call, after one warm-up call."""
    manager(data[:8])  # starts worker processes, if any
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        reward = manager(data)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), reward


def bench_workload(tokenizer, name: str, num_samples: int, repeats: int) -> list[dict]:
    data_source, make_sample = WORKLOADS[name]
    data = make_batch(tokenizer, data_source, make_sample, num_samples)
    managers = {
        "naive (in-process)": NaiveRewardManager(tokenizer, 0),
        # How a user's scorer file runs by default: one killable worker, 30 s limit per call.
        "naive, isolated worker (user scorer default)": NaiveRewardManager(tokenizer, 0, isolation="process"),
        "parallel, 2 workers": ParallelRewardManager(tokenizer, 0, num_processes=2),
        "parallel, 4 workers": ParallelRewardManager(tokenizer, 0, num_processes=4),
    }
    rows, reference = [], None
    for manager_name, manager in managers.items():
        seconds, reward = time_manager(manager, data, repeats)
        manager.close()
        if reference is None:
            reference = reward
        elif not torch.equal(reward, reference):
            sys.exit(
                f"bench_reward: {manager_name} gave a different reward tensor than the sequential manager"
            )
        rows.append(
            {
                "workload": name,
                "manager": manager_name,
                "seconds": seconds,
                "samples_per_s": num_samples / seconds,
                "mean_reward": float(reward.double().sum()) / num_samples,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="100 samples, 1 repeat (smoke test)")
    parser.add_argument("--out", default="benchmarks/results/reward.json")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.repeats = 100, 1

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer(tmp)
    rows = [row for name in WORKLOADS for row in bench_workload(tokenizer, name, args.samples, args.repeats)]

    print(
        f"\nReward scoring, {args.samples} samples per workload, median of {args.repeats}, {os.cpu_count()} CPUs\n"
    )
    print("| workload | manager | seconds | samples/s |")
    print("|---|---|---:|---:|")
    for row in rows:
        print(
            f"| {row['workload']} | {row['manager']} | {row['seconds']:.4f} | {row['samples_per_s']:,.0f} |"
        )
    result = {
        "benchmark": "reward_scoring",
        "samples": args.samples,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
