"""End-to-end: the whole trainer on the quickstart's tiny model and synthetic task, 3 steps.

GRPO and PPO (critic + GAE) run at tp=1 (one process), tp=2 and pp=2 (two processes).
The rollout draws the same tokens whatever the layout, so every layout must log the
same rewards and lengths and (up to float rounding) the same losses, gradient norms,
validation scores and final weights. A dp=2 run generates half the prompts per rank
and gathers them: its log-probs must still line up with the sampled tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.closeness import assert_close_report

QUICKSTART = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml"
)

TINY = [
    "quickstart.num_digits=2",  # 100 strings: 80 train / 20 validation prompts
    "data.train_batch_size=8",
    "data.max_response_length=3",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",  # two optimizer steps per training step
    "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_mini_batch_size=4",
    "critic.ppo_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=3",
    "trainer.test_freq=3",
    "trainer.save_freq=3",
    "trainer.resume_mode=disable",
    "trainer.logger=[console]",
]
PPO = ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95", "critic.optim.lr=1e-3"]
# A KL loss is left out of the layout comparisons: when every advantage of a mini-batch is 0,
# its gradient is rounding noise (~1e-9) that Adam scales up to a full step, differently per layout.
GRPO_KL = ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.01"]

# Metrics that depend on the sampled tokens only: identical in every layout.
EXACT = ("critic/score/mean", "critic/rewards/mean", "response_length/mean", "prompt_length/mean")
# Metrics computed by the model: equal up to the rounding of a different reduction order.
CLOSE = (
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/kl_loss",
    "critic/vf_loss",
    "critic/values/mean",
)


def train_job(out_dir: str, overrides: list[str]) -> dict:
    """Runs on every rank of a pool: a whole training run; rank 0 returns its metrics and export."""
    import torch.distributed as dist

    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    summary = run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *TINY, *overrides])
    if dist.get_rank() != 0:
        return {}
    import json

    from safetensors.torch import load_file

    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    return {
        "parallel": config["parallel"],
        "out_dir": out_dir,
        "summary": summary,
        "rows": read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl")),
        "export": load_file(os.path.join(out_dir, "hf_export", "model.safetensors")),
        "files": sorted(os.listdir(out_dir)),
        "checkpoint": sorted(os.listdir(os.path.join(out_dir, "global_step_3"))),
    }


def _by_step(rows: list[dict]) -> dict[int, dict]:
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return merged


def _check_run(result: dict, world: int, critic: bool, lowest_score: float = 0.0) -> dict[int, dict]:
    """What every run must show, whatever its layout."""
    steps = _by_step(result["rows"])
    assert sorted(steps) == [0, 1, 2, 3]
    val_failures = {f"val/reward/{kind}_count" for kind in ("timeout", "error", "invalid")}
    # The project's name and verl's (one greedy sample per prompt: mean@1). As in verl, the
    # core metric is "acc" when the reward manager reports one (DAPO does), else "reward".
    core_var = "acc" if "val-core/synthetic/reverse/acc/mean@1" in steps[0] else "reward"
    verl_names = {f"val-core/synthetic/reverse/{core_var}/mean@1"}
    if core_var == "acc":
        verl_names.add("val-aux/synthetic/reverse/reward/mean@1")
    assert set(steps[0]) == {"step", "val/test_score/synthetic/reverse", *val_failures, *verl_names}
    assert all(steps[0][key] == 0 for key in val_failures)
    # The reward's mean (acc is DAPO's task accuracy, without its overlong shaping).
    reward_name = f"val-{'aux' if core_var == 'acc' else 'core'}/synthetic/reverse/reward/mean@1"
    assert steps[0][reward_name] == pytest.approx(steps[0]["val/test_score/synthetic/reverse"])
    stages = {"gen", "reward", "old_log_prob", "adv", "update_actor", "step"} | (
        {"values", "update_critic"} if critic else set()
    )
    for step in (1, 2, 3):
        m = steps[step]
        assert {k[len("timing_s/") :] for k in m if k.startswith("timing_s/")} >= stages
        # 8 prompts x 4 samples, each prompt 5 tokens (<|user|> 2 digits eos <|assistant|>).
        assert m["prompt_length/mean"] == 5.0 and 1.0 <= m["response_length/mean"] <= 3.0
        assert m["perf/throughput"] == pytest.approx(
            m["perf/total_num_tokens"] / (m["timing_s/step"] * world)
        )
        # The trainer's log-probs of the gathered responses match the sampler's own.
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert lowest_score <= m["critic/score/mean"] <= 1.0 and m["actor/lr"] == 1e-3
        assert ("critic/vf_loss" in m) == critic
    assert "timing_s/testing" in steps[3] and "timing_s/save_checkpoint" in steps[3]
    assert result["summary"]["val/first_step"] == 0 and result["summary"]["val/last_step"] == 3
    assert {"metrics.jsonl", "curves.png", "hf_export", "global_step_3"} <= set(result["files"])
    assert "actor" in result["checkpoint"] and (("critic" in result["checkpoint"]) == critic)
    return steps


def _assert_same_run(reference: dict, other: dict) -> None:
    ref_steps, steps = _by_step(reference["rows"]), _by_step(other["rows"])
    for step in (1, 2, 3):
        for key in EXACT:
            assert steps[step][key] == ref_steps[step][key], (step, key)
        for key in CLOSE:
            if key in ref_steps[step]:
                assert steps[step][key] == pytest.approx(ref_steps[step][key], rel=1e-4, abs=1e-6), (
                    step,
                    key,
                )
    for step in (0, 3):
        assert (
            steps[step]["val/test_score/synthetic/reverse"]
            == ref_steps[step]["val/test_score/synthetic/reverse"]
        )
    # Adam divides by sqrt(v): where a gradient is tiny its rounding shows ~100x in the step.
    assert_close_report(other["export"], reference["export"], rtol=0, atol=1e-4, what="exported weights")
    for name, tensor in reference["export"].items():
        assert (other["export"][name] - tensor).norm() < 1e-4 * tensor.norm(), name


@pytest.fixture(scope="module")
def grpo_reference(pool1, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("grpo_tp1"))
    return pool1.run("tests.test_e2e:train_job", out_dir=out, overrides=[])[0]


def test_grpo_tp1_writes_everything_and_the_export_scores_like_validation(grpo_reference):
    steps = _check_run(grpo_reference, world=1, critic=False)
    # The exported checkpoint, run by Hugging Face greedy decoding on the validation prompts,
    # earns the score the trainer's own last validation reported.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_megatron.data.dataset import read_rows
    from verl_megatron.utils.reward_score import default_compute_score

    export = os.path.join(grpo_reference["out_dir"], "hf_export")
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    rows = read_rows(os.path.join(grpo_reference["out_dir"], "assets", "data", "val.parquet"))
    scores = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        response = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        scores.append(
            default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"])
        )
    assert len(scores) == 20
    assert sum(scores) / len(scores) == pytest.approx(steps[3]["val/test_score/synthetic/reverse"], abs=1e-6)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_grpo_layouts_match_one_process(pool2, tmp_path, grpo_reference, layout):
    result = pool2.run("tests.test_e2e:train_job", out_dir=str(tmp_path), overrides=layout)[0]
    key, value = layout[0].removeprefix("parallel.").split("=")
    assert result["parallel"][key] == int(value)
    _check_run(result, world=2, critic=False)
    _assert_same_run(grpo_reference, result)


@pytest.mark.multiproc
def test_grpo_dp2_with_kl_loss_gathers_each_ranks_samples(pool2, tmp_path, grpo_reference):
    result = pool2.run("tests.test_e2e:train_job", out_dir=str(tmp_path), overrides=GRPO_KL)[0]
    steps = _check_run(result, world=2, critic=False)
    # k3 (low_var_kl) is >= 0, and small: the policy is 6 small steps away from the reference.
    assert all(0.0 <= steps[s]["actor/kl_loss"] < 0.5 for s in (1, 2, 3))
    # Greedy validation of the initial weights does not depend on the layout.
    ref_steps = _by_step(grpo_reference["rows"])
    assert steps[0]["val/test_score/synthetic/reverse"] == ref_steps[0]["val/test_score/synthetic/reverse"]


@pytest.fixture(scope="module")
def ppo_reference(pool1, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ppo_tp1"))
    return pool1.run("tests.test_e2e:train_job", out_dir=out, overrides=PPO)[0]


def test_ppo_tp1_trains_the_critic(ppo_reference):
    steps = _check_run(ppo_reference, world=1, critic=True)
    for step in (1, 2, 3):
        m = steps[step]
        assert m["critic/vf_loss"] > 0.0 and m["critic/lr"] == 1e-3
        # GAE advantages are whitened over the batch's response tokens.
        assert abs(m["critic/advantages/mean"]) < 1e-5
    # A fresh value head predicts ~0 at first; the critic moves its predictions.
    assert steps[3]["critic/values/mean"] != steps[1]["critic/values/mean"]


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp2", "pp2"])
def test_ppo_layouts_match_one_process(pool2, tmp_path, ppo_reference, layout):
    result = pool2.run("tests.test_e2e:train_job", out_dir=str(tmp_path), overrides=[*PPO, *layout])[0]
    key, value = layout[0].removeprefix("parallel.").split("=")
    assert result["parallel"][key] == int(value)
    _check_run(result, world=2, critic=True)
    _assert_same_run(ppo_reference, result)


def test_dapo_dynamic_sampling_and_overlong_penalty(pool1, tmp_path):
    dapo = [
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=20",
        "data.gen_batch_size=8",
        "actor.clip_ratio_high=0.28",
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=1",  # a 3-token (maximal) response loses 1
        "reward_model.overlong_buffer.penalty_factor=1.0",
    ]
    result = pool1.run("tests.test_e2e:train_job", out_dir=str(tmp_path), overrides=dapo)[0]
    steps = _check_run(result, world=1, critic=False, lowest_score=-1.0)
    for step in (1, 2, 3):
        m = steps[step]
        assert m["train/num_kept_groups"] >= 8 and m["train/num_gen_batches"] >= 1
        assert m["train/num_gen_batches"] == int(m["train/num_gen_batches"])
        # Task scores are in [0, 1]; every maximal-length response also gets -1.
        assert (
            m["critic/score/min"] >= -1.0 and m["critic/score/mean"] <= 1.0 - m["response_length/clip_ratio"]
        )
    # Validation has the same overlong shaping (verl's DAPO recipe): a maximal response loses 1.
    assert -1.0 <= steps[3]["val/test_score/synthetic/reverse"] <= 1.0
