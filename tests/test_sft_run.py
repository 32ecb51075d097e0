"""``verl-megatron sft`` end to end: configs/sft_quickstart.yaml trains, checkpoints, resumes to the
same numbers as an uninterrupted run, exports a Hugging Face model, and trains LoRA adapters."""

from __future__ import annotations

import math
import os

from tests.test_recipes import ROOT, recipe_job  # noqa: F401  (the pool runs it by this module's name)

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


def test_sft_quickstart_resumes_to_the_uninterrupted_numbers(pool1, tmp_path):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    (full,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=whole,
                        overrides=[*SMALL, "trainer.total_training_steps=4"])  # fmt: skip
    pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=parts,
              overrides=[*SMALL, "trainer.total_training_steps=2"])  # fmt: skip
    (resumed,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=parts,
                           overrides=[*SMALL, "trainer.total_training_steps=4"])  # fmt: skip
    a, b = _steps(full["rows"]), _steps(resumed["rows"])
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    assert full["config"]["trainer"]["mode"] == "sft" and full["config"]["actor"]["rollout_n"] == 1
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "actor/grad_norm", "actor/lr", "train/num_tokens"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
        assert math.isfinite(a[step]["train/loss"]) and a[step]["actor/skipped_steps"] == 0.0
    for step in (0, 2, 4):
        assert a[step]["val/loss"] == b[step]["val/loss"], step
    # A random-init model's loss is about log(vocabulary); four steps at lr 3e-3 lower it.
    assert a[4]["val/loss"] < a[0]["val/loss"] < 3.5
    assert {"hf_export", "global_step_2", "global_step_4", "metrics.jsonl"} <= set(full["files"])
    assert os.path.isfile(os.path.join(whole, "assets", "data", "sft", "train.parquet"))


def test_sft_with_lora_trains_adapters(pool1, tmp_path):
    out = str(tmp_path / "lora")
    overrides = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "trainer.total_training_steps=1",
                 "trainer.val_before_train=false", "model.lora_rank=4", "model.lora_alpha=8"]  # fmt: skip
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_quickstart", out_dir=out, overrides=overrides)
    step = _steps(result["rows"])[1]
    assert step["actor/grad_norm"] > 0 and math.isfinite(step["val/loss"])
    assert {"hf_export", "lora_adapter"} <= set(result["files"])
    assert os.path.isfile(os.path.join(ROOT, "configs", "sft_quickstart.yaml"))
