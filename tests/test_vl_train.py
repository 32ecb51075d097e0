"""One GRPO step of the whole trainer on the tiny Qwen2.5-VL with image rows.

Eight rows of the shapes task (a coloured square or circle, "<image>What colour is the shape?")
go through the trainer's dataset (images decoded, prompts encoded with the checkpoint's image
processor, 3-D rotary ids), the native rollout (n=2, images embedded once per prompt) and the
actor's update; a reward function scores the colour word (plus a tie-breaker). The step must log
finite metrics and a non-zero gradient, the prompts must carry their image tokens (prompt lengths
differ by the images' token counts) and the rollout's log-probs must be the actor's old log-probs.
"""

from __future__ import annotations

import json
import math
import os

from tests.test_e2e import QUICKSTART
from tests.test_vl_actor import vl_path  # noqa: F401  (fixture)

COLOURS = ["red", "blue", "green", "yellow"]

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth in solution_str) + 0.1 * (sum(map(ord, solution_str)) % 3)
"""


def _rows(folder: str) -> str:
    from verl_megatron.utils.local_vl_assets import shape_image

    rows = []
    for i in range(8):
        colour, kind = COLOURS[i % 4], ("square", "circle")[i // 4]
        image = os.path.join(folder, f"{i}.png")
        shape_image((28 * (1 + i % 2), 28), colour, kind).save(image)
        rows.append({
            "prompt": [{"role": "user", "content": "<image>What colour is the shape?"}],
            "images": [{"path": f"{i}.png"}],
            "data_source": "shapes",
            "reward_model": {"ground_truth": colour},
        })  # fmt: skip
    path = os.path.join(folder, "shapes.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    return path


def vl_train_job(path: str, out_dir: str) -> dict:
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    data = _rows(out_dir)
    reward = os.path.join(out_dir, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    run(QUICKSTART, [
        "quickstart.enable=false", f"model.path={path}", f"data.train_files=[{data}]",
        "data.shuffle=false", "data.max_prompt_length=48", "data.max_response_length=4", "data.train_batch_size=4",
        "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
        "actor.entropy_coeff=0.01",  # a gradient even when every group's rewards tie
        f"custom_reward_function.path={reward}", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.export_hf=false",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", "trainer.logger=[console]",
    ])  # fmt: skip
    return read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))[-1]


def test_grpo_step_on_image_rows(pool1, vl_path, tmp_path):  # noqa: F811
    (row,) = pool1.run(f"{__name__}:vl_train_job", path=vl_path, out_dir=str(tmp_path))
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        assert key in row and math.isfinite(row[key]), f"{key}: {row.get(key)}"
    assert row["actor/grad_norm"] > 0, row["actor/grad_norm"]
    # The same text; the 28x28 and 56x28 images expand to 1 and 2 image tokens (measured 28 / 29).
    assert row["prompt_length/max"] == row["prompt_length/min"] + 1 > 20, row
    # The rollout's log-probs (images embedded in its prefill) are the actor's (measured 4.8e-7).
    assert row["rollout/logprob_diff/max"] < 1e-4, row["rollout/logprob_diff/max"]
