"""Every shipped recipe trains: configs/grpo.yaml, ppo.yaml, dapo.yaml, grpo_moe.yaml,
quickstart_moe.yaml, quickstart_vl.yaml and sft.yaml each run one step on CPU.

Each recipe runs as written (bf16 mixed precision, its loss, estimator, KL, critic, dynamic
sampling, overlong penalty, validation, checkpointing) with only sizes overridden: a tiny
Qwen2-family model with a byte-level BPE tokenizer, a few GSM8K-style rows converted by the
project's own converter, short prompts and responses, small batches and one step.
(configs/quickstart.yaml runs in tests/test_quickstart.py, sft_quickstart.yaml in tests/test_sft_run.py.)
"""

from __future__ import annotations

import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESPONSE_LENGTH = 8

# A random model never solves GSM8K, so every DAPO group would score the same 'acc' and
# dynamic sampling would drop them all. The DAPO run scores with this float scorer instead,
# whose value varies with the sampled text: what the recipe's filter needs to keep a group.
VARIED_SCORER = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
"""


def _gsm8k_rows(n: int, offset: int) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        a, b = 3 + i, 4 + 2 * i
        answer = f"{a} plus {b} is <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"
        rows.append({"question": f"What is {a} plus {b}?", "answer": answer})
    return rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """Tiny model + tokenizer, GSM8K train/test parquet made by the converter, a scorer file."""
    from verl_megatron.data import gsm8k_format
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_hf_model

    root = tmp_path_factory.mktemp("recipes")
    model = root / "model"
    tokenizer = build_bpe_tokenizer(model)
    build_tiny_hf_model(
        model, "qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, tokenizer=tokenizer, seed=3,
    )  # fmt: skip
    for split, n, offset in (("train", 16, 0), ("test", 4, 100)):
        raw = root / f"gsm8k_{split}.jsonl"
        raw.write_text("".join(json.dumps(r) + "\n" for r in _gsm8k_rows(n, offset)))
        gsm8k_format.main(["--in", str(raw), "--out", str(root / "gsm8k"), "--split", split])
    scorer = root / "varied_score.py"
    scorer.write_text(VARIED_SCORER)
    return {"model": str(model), "data": str(root / "gsm8k"), "scorer": str(scorer)}


def sizes(assets: dict[str, str], out_dir: str) -> list[str]:
    """The overrides every recipe gets: where things are and how big, nothing algorithmic."""
    return [
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['data']}/train.parquet]",
        f"data.val_files=[{assets['data']}/test.parquet]",
        "data.max_prompt_length=64",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={out_dir}",
        "trainer.logger=[console]",
    ]


RECIPES = {
    # Mini-batches hold a multiple of the recipe's micro-batch size (4 for grpo and ppo).
    "grpo": ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"],
    "ppo": [
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",  # two actor and two critic steps
        "critic.ppo_mini_batch_size=4",
    ],
    "grpo_moe": ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"],
    "dapo": [
        "data.train_batch_size=2",
        "data.gen_batch_size=4",
        "actor.ppo_mini_batch_size=2",
        "reward_model.overlong_buffer.len=4",  # the recipe's buffer is half the response length too
    ],
}


def recipe_job(recipe: str, out_dir: str, overrides: list[str]) -> dict:
    """One training run of configs/<recipe>.yaml in a pool worker; its metrics rows and saved config."""
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    run(os.path.join(ROOT, "configs", f"{recipe}.yaml"), [f"trainer.default_local_dir={out_dir}", *overrides])
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    return {
        "rows": read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl")),
        "config": config,
        "files": sorted(os.listdir(out_dir)),
    }


def _run(pool1, assets, tmp_path, recipe: str, extra: list[str] = ()) -> tuple[dict, dict, dict]:
    out = str(tmp_path / recipe)
    (result,) = pool1.run(
        f"{__name__}:recipe_job",
        recipe=recipe,
        out_dir=out,
        overrides=[*sizes(assets, out), *RECIPES[recipe], *extra],
    )
    steps: dict[int, dict] = {}
    for row in result["rows"]:
        steps.setdefault(row["step"], {}).update(row)
    assert sorted(steps) == [0, 1], sorted(steps)
    first = steps[1]
    assert first["training/global_step"] == 1.0
    bad = {k: v for k, v in first.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics: {bad}"
    # The recipe's own settings were kept: bf16, validation before and after, a checkpoint.
    assert result["config"]["model"]["dtype"] == "bfloat16"
    assert "val/test_score/openai/gsm8k" in steps[0] and "val/test_score/openai/gsm8k" in first
    assert "global_step_1" in result["files"]
    assert 1.0 <= first["response_length/mean"] <= RESPONSE_LENGTH
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"):
        assert key in first, key
    return result, steps, first


def test_grpo_recipe_runs_a_step_and_resumes(pool1, assets, tmp_path):
    result, _, m = _run(pool1, assets, tmp_path, "grpo")
    # GRPO: a KL loss against the reference, no critic; 5 samples per prompt.
    assert result["config"]["rollout"]["n"] == 5
    assert m["actor/kl_loss"] >= 0.0 and "critic/vf_loss" not in m
    assert m["actor/lr"] == 1e-6
    # The bf16 checkpoint (weights, fp32 main weights, Adam moments) loads: a second run
    # in the same folder resumes from step 1 and trains step 2.
    out = str(tmp_path / "grpo")
    overrides = [*sizes(assets, out), *RECIPES["grpo"], "trainer.total_training_steps=2"]
    (resumed,) = pool1.run(f"{__name__}:recipe_job", recipe="grpo", out_dir=out, overrides=overrides)
    steps = sorted({row["step"] for row in resumed["rows"]})
    assert steps == [0, 1, 2], steps
    assert sum("actor/pg_loss" in row for row in resumed["rows"] if row["step"] == 1) == 1  # not retrained
    second = {k: v for row in resumed["rows"] if row["step"] == 2 for k, v in row.items()}
    assert math.isfinite(second["actor/pg_loss"]) and "global_step_2" in resumed["files"]


def test_ppo_recipe_runs_a_step(pool1, assets, tmp_path):
    result, _, m = _run(pool1, assets, tmp_path, "ppo")
    # PPO: a critic trained with GAE, a KL penalty in the reward, no KL loss.
    assert {"critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/reward_kl_penalty"} <= set(m)
    assert "actor/kl_loss" not in m
    assert result["config"]["algorithm"]["adv_estimator"] == "gae"


def test_dapo_recipe_runs_a_step(pool1, assets, tmp_path):
    extra = [f"custom_reward_function.path={assets['scorer']}", "custom_reward_function.name=compute_score"]
    result, _, m = _run(pool1, assets, tmp_path, "dapo", extra)
    cfg = result["config"]
    # Dynamic sampling on 'acc' kept 2 prompt groups of 16 samples; the overlong penalty is on.
    assert cfg["algorithm"]["filter_groups"] == {"enable": True, "metric": "acc", "max_num_gen_batches": 10}
    assert cfg["reward_model"]["overlong_buffer"]["enable"] and cfg["actor"]["clip_ratio_high"] == 0.28
    assert m["train/num_gen_batches"] >= 1.0 and m["train/num_kept_groups"] >= 2.0
    assert "actor/kl_loss" not in m and "critic/vf_loss" not in m
    # The scorer gives 0 or 1; the overlong penalty can only lower a score.
    assert -1.0 <= m["critic/score/mean"] <= 1.0


def test_dynamic_sampling_on_acc_uses_a_float_scorers_score():
    import numpy as np
    import torch

    from verl_megatron.protocol import DataProto
    from verl_megatron.trainer.dynamic_sampling import keep_varied_groups

    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    batch = DataProto.from_dict(tensors={"token_level_scores": scores}, non_tensors={"uid": uids})
    kept, groups = keep_varied_groups(batch, "acc")
    assert groups == 1 and list(kept.non_tensor_batch["uid"]) == ["a", "a"]
    # A reward that reports its own 'acc' is filtered on it, not on the score.
    batch.non_tensor_batch["acc"] = np.array([1.0, 1.0, 0.0, 1.0], dtype=object)
    kept, groups = keep_varied_groups(batch, "acc")
    assert groups == 1 and list(kept.non_tensor_batch["uid"]) == ["b", "b"]


def test_grpo_lora_recipe_runs_a_step(pool1, tmp_path):
    """configs/grpo_lora.yaml (the quickstart task with LoRA adapters) trains a step and exports them."""
    out = str(tmp_path / "grpo_lora")
    small = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    small.append("actor.ppo_micro_batch_size_per_gpu=64")
    # Also bf16 (fp32 master copies of the adapters only) and a checkpoint of the adapters.
    small += ["model.dtype=bfloat16", "trainer.save_freq=1", "trainer.val_before_train=false"]
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="grpo_lora", out_dir=out, overrides=small)
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert result["config"]["model"]["lora_rank"] == 16 and math.isfinite(step["actor/pg_loss"])
    assert step["actor/grad_norm"] > 0.0
    with open(os.path.join(out, "lora_adapter", "adapter_config.json")) as f:
        assert json.load(f)["r"] == 16
    assert {"hf_export", "lora_adapter", "global_step_1"} <= set(result["files"])
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(os.path.join(out, "global_step_1", "actor"))
    assert keys and all(k.startswith(("layers.", "optimizer.")) for k in keys), sorted(keys)[:4]


def test_quickstart_agent_recipe_runs_a_step(pool1, tmp_path):
    """configs/quickstart_agent.yaml: every conversation through the endpoint, the tool in the
    sandbox, the agent reward manager; one GRPO step, validation on the 20 held-out keys."""
    out = str(tmp_path / "quickstart_agent")
    small = ["trainer.total_training_steps=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    small += ["rollout.n=4", "trainer.val_before_train=false"]
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="quickstart_agent", out_dir=out, overrides=small)
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert step["reward/agent/trajectories_count"] == 16 and step["val/reward/agent/trajectories_count"] == 20
    failures = sum(v for k, v in step.items() if k.startswith("reward/agent/failure_"))
    assert failures == 0 and step["reward/agent/turns_count"] >= 16, step
    assert math.isfinite(step["actor/pg_loss"]) and step["response_length/mean"] > 0


def test_sft_agent_recipe_then_grpo_from_its_export(pool1, tmp_path):
    """configs/sft_agent.yaml (one step on the lookup task's tool-use chats, HF export), then
    configs/quickstart_agent.yaml from that export: the README's two-command agent recipe."""
    from verl_megatron.data.dataset import read_rows

    sft_out, small = str(tmp_path / "sft_agent"), ["trainer.total_training_steps=1"]
    (sft,) = pool1.run(f"{__name__}:recipe_job", recipe="sft_agent", out_dir=sft_out, overrides=small)
    steps = {row["step"]: row for row in sft["rows"]}
    assert sft["config"]["trainer"]["mode"] == "sft" and "hf_export" in sft["files"]
    assert math.isfinite(steps[0]["val/loss"]) and steps[1]["val/loss"] < steps[0]["val/loss"], steps
    chats = read_rows(os.path.join(sft_out, "assets", "data", "sft", "train.parquet"))
    roles = [m["role"] for m in chats[0]["messages"]]
    assert len(chats) == 80 and roles == ["user", "assistant", "tool", "assistant"], roles
    small += ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2"]
    small += ["trainer.test_freq=-1", f"model.path={sft_out}/hf_export"]  # validation: the test above
    out = str(tmp_path / "agent_from_sft")
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="quickstart_agent", out_dir=out, overrides=small)
    step = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert result["config"]["model"]["path"].endswith("hf_export"), result["config"]["model"]
    failures = sum(v for k, v in step.items() if k.startswith("reward/agent/failure_"))
    assert step["reward/agent/trajectories_count"] == 8 and failures == 0, step
    assert step["reward/agent/turns_count"] >= 8 and math.isfinite(step["actor/pg_loss"]), step


def test_grpo_moe_recipe_runs_a_step(pool1, assets, tmp_path):
    from verl_megatron.utils.local_assets import build_bpe_tokenizer, build_tiny_hf_model

    model = tmp_path / "moe_model"
    build_tiny_hf_model(
        model, "qwen2_moe", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, tokenizer=build_bpe_tokenizer(model), seed=3,
    )  # fmt: skip
    result, _, m = _run(pool1, {**assets, "model": str(model)}, tmp_path, "grpo_moe")
    assert result["config"]["parallel"]["ep"] == 1
    assert m["actor/moe/aux_loss"] > 0.0 and m["actor/moe/load_imbalance"] >= 1.0


def test_quickstart_moe_runs_a_step(pool1, tmp_path):
    out = str(tmp_path / "quickstart_moe")
    overrides = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    overrides.append("actor.ppo_micro_batch_size_per_gpu=64")  # 8 prompts x 8 samples
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="quickstart_moe", out_dir=out, overrides=overrides)
    last = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert result["config"]["quickstart"]["family"] == "qwen3_moe"
    assert last["actor/moe/aux_loss"] > 0.0 and "val/test_score/synthetic/reverse" in last


def test_quickstart_deepseek_runs_a_step(pool1, tmp_path):
    """configs/quickstart_deepseek.yaml builds a tiny DeepSeek-V3 (MLA, sigmoid routing with expert
    biases, a shared expert) and trains a step on it; benchmarks/results/quickstart_deepseek.json
    is its full run."""
    from safetensors.torch import load_file

    out = str(tmp_path / "quickstart_deepseek")
    overrides = ["trainer.total_training_steps=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    overrides += ["actor.ppo_micro_batch_size_per_gpu=64", "trainer.val_before_train=false"]
    (result,) = pool1.run(
        f"{__name__}:recipe_job", recipe="quickstart_deepseek", out_dir=out, overrides=overrides
    )
    last = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    with open(os.path.join(out, "assets", "model", "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "deepseek_v3" and hf["n_routed_experts"] == 8 and hf["kv_lora_rank"] == 32
    assert math.isfinite(last["actor/pg_loss"]) and "val/test_score/synthetic/reverse" in last, last
    # One optimizer step moved every exported expert bias (aux-loss-free balancing) by the rate, 1e-3.
    (before,) = _expert_biases(load_file(os.path.join(out, "assets", "model", "model.safetensors")))
    (after,) = _expert_biases(load_file(os.path.join(out, "hf_export", "model.safetensors")))
    moved = (after - before).abs()
    assert (moved - 1e-3).abs().max() < 1e-6, f"expert biases moved by {moved.tolist()} (rate 1e-3)"


def test_quickstart_vl_runs_a_step(pool1, tmp_path):
    """configs/quickstart_vl.yaml builds a tiny Qwen2.5-VL with a 20-word tokenizer and the shapes
    data (56x56 images: 4 image tokens, 15-token prompts), trains a step on image rows and exports;
    benchmarks/results/vl_learning.json is its full run."""
    out = str(tmp_path / "quickstart_vl")
    overrides = ["trainer.total_training_steps=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
    overrides.append("trainer.val_before_train=false")  # the validation after step 1 runs
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="quickstart_vl", out_dir=out, overrides=overrides)
    last = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    with open(os.path.join(out, "hf_export", "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "qwen2_5_vl" and hf["text_config"]["vocab_size"] == 20, hf
    assert last["prompt_length/max"] == last["prompt_length/min"] == 15, last
    assert math.isfinite(last["actor/pg_loss"]) and last["actor/grad_norm"] > 0, last
    assert last["rollout/logprob_diff/max"] < 1e-4 and 0 <= last["val/test_score/synthetic/shapes"] <= 1, last


def _expert_biases(state: dict) -> list:
    return [v for k, v in state.items() if k.endswith("e_score_correction_bias")]


def _sft_rows(n: int, offset: int) -> list[dict]:
    """Multi-turn chats (every assistant turn trained) and prompt/response rows, alternating."""
    rows = []
    for i in range(offset, offset + n):
        a, b = 3 + i, 4 + 2 * i
        if i % 2:
            rows.append({"prompt": f"What is {a} plus {b}?", "response": f"{a + b}"})
            continue
        chat = [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a + b}"},
            {"role": "user", "content": "And times two?"},
            {"role": "assistant", "content": f"{2 * (a + b)}"},
        ]
        rows.append({"messages": chat})
    return rows


def test_sft_recipe_runs_a_step(pool1, assets, tmp_path):
    """configs/sft.yaml as written (bf16, packed rows, dynamic micro-batches, validation loss before
    and after, a checkpoint, the HF export) on multi-turn and prompt/response rows."""
    for split, n, offset in (("sft_train", 8, 0), ("sft_val", 4, 100)):
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _sft_rows(n, offset)))
    out = str(tmp_path / "sft")
    overrides = [
        f"model.path={assets['model']}",
        f"data.train_files=[{tmp_path}/sft_train.jsonl]",
        f"data.val_files=[{tmp_path}/sft_val.jsonl]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1",
        "trainer.save_freq=1",
    ]
    (result,) = pool1.run(f"{__name__}:recipe_job", recipe="sft", out_dir=out, overrides=overrides)
    steps = {row["step"]: row for row in result["rows"]}
    assert result["config"]["model"]["dtype"] == "bfloat16" and result["config"]["trainer"]["mode"] == "sft"
    assert result["config"]["actor"]["use_dynamic_bsz"] and result["config"]["actor"]["use_remove_padding"]
    first = {k: v for row in result["rows"] if row["step"] == 1 for k, v in row.items()}
    assert math.isfinite(steps[0]["val/loss"]) and math.isfinite(first["val/loss"])
    assert math.isfinite(first["train/loss"]) and first["actor/grad_norm"] > 0
    assert first["train/num_tokens"] > 0 and first["actor/lr"] > 0
    assert {"global_step_1", "hf_export"} <= set(result["files"])
