"""A training step of the quickstart with the reward model and the native judge enabled.

The batch the step trains on carries ``rule + rm + judge`` at each response's last token:
``rm`` equal to transformers' AutoModelForSequenceClassification on the sampled
conversations, ``judge`` the verdicts the actor's own engine gave (a digit, or 0 when its
answer holds none, counted in ``reward/judge/unparsable_count``).
"""

from __future__ import annotations

import os

import torch

from tests.helpers import SMALL_MODEL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rm_step_job(out_dir: str, rm_path: str) -> dict:
    from verl_megatron.distributed.parallel import init_runtime
    from verl_megatron.trainer.components import build_components
    from verl_megatron.trainer.ppo.reward import compute_reward
    from verl_megatron.trainer.ppo_trainer import PPOTrainer
    from verl_megatron.trainer.preflight import prepare_run
    from verl_megatron.trainer.quickstart import prepare_quickstart_assets

    overrides = [
        f"trainer.default_local_dir={out_dir}",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.export_hf=false",
        "quickstart.hidden_size=32",
        "quickstart.intermediate_size=64",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_path}",
        "reward_model.micro_batch_size_per_gpu=3",
        "reward_model.combine=rule + rm + judge",
        "reward_model.judge.enable=true",
        "reward_model.judge.backend=native",
        "reward_model.judge.prompt_template=1{response}",
        "reward_model.judge.verdict_pattern=\\d",
        "reward_model.judge.max_tokens=3",
    ]
    config, _, _ = prepare_run(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides, 1)
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    config = prepare_quickstart_assets(config, runtime.rank)
    config, components = build_components(config, runtime)
    trainer = PPOTrainer(config, runtime, components)
    seen = []
    collect = trainer._collect_batch

    def spy(step, timing):
        batch, metrics = collect(step, timing)
        seen.append(batch)
        return batch, metrics

    trainer._collect_batch = spy
    try:
        metrics = trainer.train_step(1)
        (batch,) = seen
        rule, _ = compute_reward(batch, trainer.reward_fn)
    finally:
        trainer.model_rewards.close()
        trainer.reward_fn.close()
    return {
        "metrics": metrics,
        "scores": batch.batch["token_level_scores"],
        "response_mask": batch.batch["response_mask"],
        "input_ids": batch.batch["input_ids"],
        "attention_mask": batch.batch["attention_mask"],
        "rule": rule.sum(-1),
        "rm_score": list(batch.non_tensor_batch["rm_score"]),
        "judge_score": list(batch.non_tensor_batch["judge_score"]),
    }


def test_rm_and_native_judge_scores_reach_token_level_scores(pool1, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from verl_megatron.trainer.quickstart import DIGITS
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_reward_model

    rm_path = str(tmp_path / "rm")
    tokenizer = build_char_tokenizer(rm_path, alphabet=DIGITS)  # the quickstart actor's vocabulary
    build_tiny_reward_model(rm_path, "llama", tokenizer=tokenizer, **SMALL_MODEL)
    (out,) = pool1.run(f"{__name__}:rm_step_job", out_dir=str(tmp_path / "run"), rm_path=rm_path)

    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected_rm = torch.tensor(
            [
                float(model(input_ids=ids[mask.bool()].unsqueeze(0)).logits[0, 0])
                for ids, mask in zip(out["input_ids"], out["attention_mask"])
            ]
        )
    torch.testing.assert_close(torch.tensor(out["rm_score"]), expected_rm, rtol=0, atol=1e-4)
    judge = torch.tensor(out["judge_score"], dtype=torch.float32)
    assert set(judge.tolist()) <= set(range(10))  # a digit, or the failure score 0
    lengths = out["response_mask"].sum(-1)
    rows = torch.arange(len(lengths))
    at_last = out["scores"][rows, lengths - 1]
    torch.testing.assert_close(at_last, out["rule"] + expected_rm + judge, rtol=0, atol=1e-4)
    elsewhere = out["scores"].clone()
    elsewhere[rows, lengths - 1] = 0.0
    assert float(elsewhere.abs().max()) == 0.0
    metrics = out["metrics"]
    assert abs(metrics["critic/score/mean"] - float(at_last.mean())) < 1e-5
    assert 0 <= metrics["reward/judge/unparsable_count"] <= len(lengths)
    assert metrics["reward/judge/timeout_count"] == 0.0
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
