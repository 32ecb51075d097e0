"""configs/grpo_qwen3_next.yaml trains a step on a tiny Qwen3-Next; its missing features are refused.

The recipe runs as written (bf16, native rollout through the DeltaNet states, dynamic micro-batches
of packed rows, validation, a checkpoint) with only sizes overridden, on a tiny random Qwen3-Next
with a byte-level BPE tokenizer and GSM8K-style rows. LoRA, bitwise parity, context parallelism
and routing replay stop a run at start-up with one named line.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.qwen3_next_models import build_qwen3_next
from tests.test_family_deepseek_recipe import family_recipe_assets
from tests.test_recipes import ROOT, sizes
from verl_megatron import cli


@pytest.fixture(scope="module")
def q3n_assets(tmp_path_factory) -> dict[str, str]:
    return family_recipe_assets(tmp_path_factory.mktemp("q3n_recipe"), build_qwen3_next)


def test_grpo_qwen3_next_recipe_runs_a_step(pool1, q3n_assets, tmp_path):
    out = str(tmp_path / "run")
    small = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2"]
    (result,) = pool1.run(
        "tests.test_recipes:recipe_job", recipe="grpo_qwen3_next", out_dir=out,
        overrides=sizes(q3n_assets, out) + small,
    )  # fmt: skip
    first = {}
    for row in (r for r in result["rows"] if r["step"] == 1):
        first.update(row)
    assert result["config"]["model"]["dtype"] == "bfloat16" and result["config"]["actor"]["use_dynamic_bsz"]
    for key in ("actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert math.isfinite(first[key]), (key, first[key])
    assert all(math.isfinite(v) for v in first.values() if isinstance(v, float)), first
    assert "val/test_score/openai/gsm8k" in first and "global_step_1" in result["files"]


def test_routing_replay_is_one_named_line(q3n_assets, tmp_path, capsys, no_runtime):
    config = os.path.join(ROOT, "configs", "grpo_qwen3_next.yaml")
    args = ["train", "--config", config, *sizes(q3n_assets, str(tmp_path / "run")), "data.train_batch_size=2"]
    rc = cli.main([*args, "actor.ppo_mini_batch_size=2", "actor.megatron.router_replay.mode=R3",
                   "rollout.enable_rollout_routing_replay=true"])  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "routing replay" in err[0] and "qwen3_next" in err[0], err[0]


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        (dict(lora_rank=8), "model.lora_rank > 0"),
        (dict(bitwise_parity=True), "rollout.bitwise_parity=true"),
        (dict(cp=2), "parallel.cp=2"),
        (dict(routing_replay=True), "routing replay"),
    ],
    ids=["lora", "parity", "cp", "r3"],
)
def test_unsupported_features_are_refused(settings, key):
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen3_next import check_linear_features

    base = dict(lora_rank=0, bitwise_parity=False, cp=1, routing_replay=False)
    with pytest.raises(ModelConfigError, match=key.replace(".", r"\.")):
        check_linear_features("qwen3_next", **{**base, **settings})
    check_linear_features("qwen3_next", **base)
    check_linear_features("qwen3_moe", **{**base, **settings})  # other families: their own checks
