"""``verl-megatron sft`` end to end: configs/sft_quickstart.yaml trains, checkpoints, resumes after
kill -9 to the same numbers as an uninterrupted run, exports a Hugging Face model, and trains LoRA
adapters."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tests.test_recipes import ROOT, recipe_job  # noqa: F401  (the pool runs it by this module's name)

STEPS = 6
SMALL = [
    "quickstart.num_digits=2",
    "data.train_batch_size=16",
    "actor.ppo_mini_batch_size=8",
    "trainer.test_freq=2",
    "trainer.save_freq=2",
]


def _steps(rows: list[dict]) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for row in rows:
        steps.setdefault(row["step"], {}).update(row)
    return steps


def test_sft_quickstart_killed_resumes_to_the_uninterrupted_numbers(pool1, tmp_path):
    """A run SIGKILLed after its step-2 checkpoint, restarted (resume_mode auto), logs the
    uninterrupted run's numbers for every later step and exports a model transformers loads."""
    from transformers import AutoModelForCausalLM

    from tests.restart_job import wait_for_checkpoint
    from verl_megatron.checkpoint import find_latest_checkpoint

    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    (full,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=whole,
                        overrides=[*SMALL, f"trainer.total_training_steps={STEPS}"])  # fmt: skip
    command = [sys.executable, "-m", "verl_megatron.train", "--config", os.path.join(ROOT, "configs", "sft_quickstart.yaml"),
               *SMALL, f"trainer.total_training_steps={STEPS}", f"trainer.default_local_dir={parts}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_checkpoint(Path(parts), 2, [proc], deadline_s=300)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = int(find_latest_checkpoint(parts).name.rsplit("_", 1)[1])
    assert saved in (2, 4), f"the kill landed after checkpoint {saved}: nothing left to resume"
    (resumed,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=parts,
                           overrides=[*SMALL, f"trainer.total_training_steps={STEPS}"])  # fmt: skip
    a, b = _steps(full["rows"]), _steps(resumed["rows"])
    assert sorted(a) == sorted(b) == list(range(STEPS + 1))
    assert full["config"]["trainer"]["mode"] == "sft" and full["config"]["actor"]["rollout_n"] == 1
    for step in range(1, STEPS + 1):
        for key in ("train/loss", "actor/grad_norm", "actor/lr", "train/num_tokens"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
        assert math.isfinite(a[step]["train/loss"]) and a[step]["actor/skipped_steps"] == 0.0
    for step in range(0, STEPS + 1, 2):
        assert a[step]["val/loss"] == b[step]["val/loss"], step
    # A random-init model's loss is about log(vocabulary); a few steps at lr 3e-3 lower it.
    assert a[STEPS]["val/loss"] < a[0]["val/loss"] < 3.5
    assert {"hf_export", "global_step_2", f"global_step_{STEPS}", "metrics.jsonl"} <= set(full["files"])
    assert os.path.isfile(os.path.join(whole, "assets", "data", "sft", "train.parquet"))
    # The two exports are the same model, and transformers loads it.
    models = [AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf_export")) for d in (whole, parts)]
    states = [m.state_dict() for m in models]
    assert states[0].keys() == states[1].keys()
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def test_sft_with_lora_trains_adapters(pool1, tmp_path):
    out = str(tmp_path / "lora")
    overrides = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.total_training_steps=1",
                 "trainer.val_before_train=false", "model.lora_rank=4", "model.lora_alpha=8"]  # fmt: skip
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=out, overrides=overrides)
    step = _steps(result["rows"])[1]
    assert step["actor/grad_norm"] > 0 and math.isfinite(step["val/loss"])
    assert {"hf_export", "lora_adapter"} <= set(result["files"])
    assert os.path.isfile(os.path.join(ROOT, "configs", "sft_quickstart.yaml"))
