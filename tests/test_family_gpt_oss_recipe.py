"""configs/grpo_gpt_oss.yaml trains a step on a tiny GPT-OSS; the features GPT-OSS lacks are refused.

The recipe runs as written (bf16, native rollout with sinks and sliding windows, dynamic
micro-batches, validation, a checkpoint) with only sizes overridden, on the tiny random GPT-OSS of
``tests/family_gpt_oss.py`` with a byte-level BPE tokenizer and GSM8K-style rows. LoRA, bitwise
parity and routing replay stop the run at start-up with one named line (exit 2) before any process
group; context parallelism and the Transformer Engine spec are refused by the family's checks.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.family_gpt_oss import build_gpt_oss
from tests.test_family_deepseek_recipe import family_recipe_assets
from tests.test_recipes import ROOT, sizes
from verl_megatron import cli

BATCH = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2"]


@pytest.fixture(scope="module")
def oss_assets(tmp_path_factory) -> dict[str, str]:
    return family_recipe_assets(tmp_path_factory.mktemp("gpt_oss_recipe"), build_gpt_oss)


def test_grpo_gpt_oss_recipe_runs_a_step(pool1, oss_assets, tmp_path):
    out = str(tmp_path / "run")
    (result,) = pool1.run(
        "tests.test_recipes:recipe_job",
        recipe="grpo_gpt_oss",
        out_dir=out,
        overrides=[*sizes(oss_assets, out), *BATCH],
    )
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert result["config"]["model"]["dtype"] == "bfloat16" and result["config"]["actor"]["use_dynamic_bsz"]
    bad = {k: v for k, v in step.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    assert math.isfinite(step["actor/grad_norm"]) and step["response_length/mean"] > 0
    assert "global_step_1" in result["files"] and "val/test_score/openai/gsm8k" in step


REFUSED = [
    (["model.lora_rank=8"], "model.lora_rank=8: LoRA is not supported with gpt_oss"),
    (["rollout.bitwise_parity=true"], "rollout.bitwise_parity=true is not supported with gpt_oss"),
    (["rollout.enable_rollout_routing_replay=true", "actor.megatron.router_replay.mode=R3"],
     "rollout.enable_rollout_routing_replay=true is not supported with gpt_oss"),
]  # fmt: skip


def test_gpt_oss_refusals_are_one_named_line(oss_assets, tmp_path, capsys, no_runtime):
    from verl_megatron.errors import ConfigError
    from verl_megatron.models.families.gpt_oss import check_gpt_oss_features, gpt_oss_transformer_config

    base = ["train", "--config", os.path.join(ROOT, "configs", "grpo_gpt_oss.yaml"), *BATCH]
    for overrides, expected in REFUSED:
        rc = cli.main([*base, *sizes(oss_assets, str(tmp_path / "run")), *overrides])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (
            overrides,
            err,
        )
    with pytest.raises(
        ConfigError, match=r"parallel\.cp=2: context parallelism is not supported with gpt_oss"
    ):
        check_gpt_oss_features("gpt_oss", lora_rank=0, bitwise_parity=False, cp=2)
    with pytest.raises(ConfigError, match=r"gpt_oss with model\.use_te=true is not supported"):
        gpt_oss_transformer_config(None, 8, use_te=True)
    check_gpt_oss_features(
        "qwen3_moe", lora_rank=4, bitwise_parity=True, cp=2
    )  # other families: their checks
