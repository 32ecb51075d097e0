"""configs/grpo_rm.yaml trains a step: GRPO with a re-templating reward model beside the rule reward.

Same tiny Qwen2 actor and GSM8K rows as tests/test_recipes.py; the reward model is a tiny
Qwen2ForSequenceClassification with the actor's tokenizer, so the recipe's re-templating
(``reward_model.model.input_tokenizer: ${model.path}``, ``data.return_raw_chat``) runs as written.
"""

from __future__ import annotations

import math

from tests.test_recipes import assets, recipe_job, sizes  # noqa: F401 (assets is a fixture)


def test_grpo_rm_recipe_runs_a_step(pool1, assets, tmp_path):  # noqa: F811
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_reward_model

    rm_path = str(tmp_path / "rm")
    build_tiny_reward_model(
        rm_path, "qwen2", tokenizer=build_bpe_tokenizer(rm_path), hidden_size=32, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=4,
    )  # fmt: skip
    out = str(tmp_path / "grpo_rm")
    overrides = [
        *sizes(assets, out),
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        f"reward_model.model.path={rm_path}",
        "reward_model.max_length=96",
    ]
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="grpo_rm", out_dir=out, overrides=overrides)
    steps: dict[int, dict] = {}
    for row in result["rows"]:
        steps.setdefault(row["step"], {}).update(row)
    assert sorted(steps) == [0, 1]
    first = steps[1]
    bad = {k: v for k, v in first.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    cfg = result["config"]["reward_model"]
    assert (
        cfg["enable"]
        and cfg["combine"] == "rule + 0.5 * rm"
        and cfg["model"]["input_tokenizer"] == assets["model"]
    )
    # A random actor never solves GSM8K: the rule reward is 0, so every score is the reward
    # model's (scores of a random head are spread out, never all 0).
    assert first["critic/score/max"] > first["critic/score/min"]
    assert "val/test_score/openai/gsm8k" in steps[0] and "global_step_1" in result["files"]
