"""configs/grpo_deepseek_v3.yaml trains a step on a tiny DeepSeek-V3; MLA's missing features are refused.

The recipe runs as written (bf16, native rollout with routing replay R3, dynamic micro-batches,
expert-bias updates, validation, a checkpoint) with only sizes overridden, on a tiny random
DeepSeek-V3 (MLA, a dense layer, a sigmoid-routed MoE layer) with a byte-level BPE tokenizer and
GSM8K-style rows made by the project's converter. The features multi-latent attention does not
have yet (LoRA, bitwise parity, context parallelism) stop the run at start-up with one named line.
"""

from __future__ import annotations

import math
import os

import pytest

from tests.family_models import build_deepseek_v3
from tests.test_recipes import ROOT, _gsm8k_rows, sizes
from verl_megatron import cli


@pytest.fixture(scope="module")
def ds_assets(tmp_path_factory) -> dict[str, str]:
    return family_recipe_assets(
        tmp_path_factory.mktemp("dsv3_recipe"),
        lambda path, **ids: build_deepseek_v3(
            path, hidden_size=32, moe_intermediate_size=16, intermediate_size=64, **ids
        ),
    )


def family_recipe_assets(root, build) -> dict[str, str]:
    """A byte-level BPE tokenizer and ``build(path, vocab_size=, eos_token_id=, pad_token_id=)``'s
    model in ``root/model``, GSM8K-style parquet files in ``root/gsm8k``."""
    import json

    from verl_megatron.data import gsm8k_format
    from verl_megatron.utils.local_assets import build_bpe_tokenizer

    model = root / "model"
    tokenizer = build_bpe_tokenizer(model)
    ids = dict(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    build(str(model), **ids)
    for split, n, offset in (("train", 8, 0), ("test", 2, 100)):
        raw = root / f"gsm8k_{split}.jsonl"
        raw.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows(n, offset)))
        gsm8k_format.main(["--in", str(raw), "--out", str(root / "gsm8k"), "--split", split])
    return {"model": str(model), "data": str(root / "gsm8k")}


def test_grpo_deepseek_v3_recipe_runs_a_step(pool1, ds_assets, tmp_path):
    out = str(tmp_path / "run")
    overrides = [*sizes(ds_assets, out), "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"]
    (result,) = pool1.run(
        "tests.test_recipes:recipe_job", recipe="grpo_deepseek_v3", out_dir=out, overrides=overrides
    )
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    cfg = result["config"]
    assert cfg["model"]["dtype"] == "bfloat16" and cfg["actor"]["megatron"]["router_replay"]["mode"] == "R3"
    bad = {k: v for k, v in step.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/grad_norm"])
    # Routes were replayed: the share of tokens whose own (bf16) routing agrees with the rollout's
    # is logged, high but not 1 (the rollout's and the actor's bf16 forwards differ slightly).
    replay = {k: v for k, v in step.items() if k.startswith("actor/router_replay/hit_rate")}
    assert len(replay) == 2 and all(0.9 <= v <= 1.0 for v in replay.values()), replay
    assert step["actor/router_replay/bytes_per_token"] > 0
    assert "global_step_1" in result["files"] and "val/test_score/openai/gsm8k" in step


REFUSED = [
    ("lora", ["model.lora_rank=8"], "model.lora_rank > 0: LoRA is not supported with multi-latent attention"),
    ("parity", ["rollout.bitwise_parity=true"], "rollout.bitwise_parity=true is not supported with multi-latent"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "overrides", "expected"), REFUSED, ids=[c[0] for c in REFUSED])
def test_missing_mla_features_are_one_named_line(
    case, overrides, expected, ds_assets, tmp_path, capsys, no_runtime
):
    config = os.path.join(ROOT, "configs", "grpo_deepseek_v3.yaml")
    args = ["train", "--config", config, *sizes(ds_assets, str(tmp_path / "run")), "data.train_batch_size=2"]
    rc = cli.main([*args, "actor.ppo_mini_batch_size=2", "model.use_te=false", *overrides])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]


def test_unverified_features_are_refused_for_both_families():
    from verl_megatron.errors import ConfigError
    from verl_megatron.models.families.deepseek import check_family_features

    with pytest.raises(
        ConfigError, match=r"parallel.cp=2: context parallelism is not supported with multi-latent"
    ):
        check_family_features("deepseek_v3", lora_rank=0, bitwise_parity=False, cp=2)
    with pytest.raises(ConfigError, match=r"rollout.bitwise_parity=true is not supported with glm4_moe"):
        check_family_features("glm4_moe", lora_rank=0, bitwise_parity=True, cp=1)
    with pytest.raises(ConfigError, match=r"model.lora_rank > 0: LoRA is not supported with glm4_moe"):
        check_family_features("glm4_moe", lora_rank=4, bitwise_parity=False, cp=1)
    check_family_features("deepseek_v3", lora_rank=0, bitwise_parity=False, cp=1)
    check_family_features(
        "qwen3_moe", lora_rank=4, bitwise_parity=True, cp=2
    )  # other families: their own checks
