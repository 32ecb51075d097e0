"""PPOTrainer pieces with scripted stand-ins for the rollout and the reward: DAPO dynamic
sampling, advantages with KL-in-reward and ReMax baselines, skipped-step reporting."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_megatron.data import PromptLoader, RLHFDataset
from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.base import RolloutEngine, assemble_output
from verl_megatron.trainer.components import Components
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.ppo_trainer import PPOTrainer
from verl_megatron.utils.local_assets import build_char_tokenizer

QUICKSTART = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml"
)
EOS, PAD, LOW, HIGH = 1, 0, 7, 8  # char tokenizer over digits: '1' is id 7, '2' is id 8


class ScriptedRollout(RolloutEngine):
    """Call c answers prompt j's k-th sample with token ``plan[c][j][k]`` then EOS.

    ``events`` records the trainer's engine hooks and generations in order."""

    def __init__(self, plan: list[list[tuple[int, ...]]]) -> None:
        self.plan = plan
        self.calls: list[dict] = []
        self.events: list[str] = []

    def sync_weights(self) -> None:
        self.events.append("sync")

    def wake_up(self) -> None:
        self.events.append("wake")

    def wake_up_weights(self) -> None:
        self.events.append("wake_weights")

    def sleep(self) -> None:
        self.events.append("sleep")

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        step = self.plan[len(self.calls)]
        self.events.append("gen")
        self._calls += 1
        self.calls.append(dict(prompts.meta_info))
        n = len(step[0])
        tokens = torch.tensor([[t, EOS] for group in step[: len(prompts)] for t in group])
        mask = torch.ones_like(tokens)
        return assemble_output(prompts, tokens, mask, None, n)


def score_first_token(data: DataProto, return_dict: bool = False):
    """Reward (token - 7) at the last response token; 'acc' is 1 for token 8."""
    first = data.batch["responses"][:, 0]
    reward = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
    reward[:, 1] = (first - LOW).float()
    extra = {"acc": [float(t == HIGH) for t in first.tolist()]}
    return {"reward_tensor": reward, "reward_extra_info": extra} if return_dict else reward


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    tokenizer = build_char_tokenizer(root / "tok", alphabet="0123456789")
    rows = [
        {
            "data_source": "synthetic/copy",
            "prompt": [{"role": "user", "content": str(i)}],
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(8)
    ]
    path = root / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    config = load_config(QUICKSTART, [f"data.train_files=[{path}]", "data.max_prompt_length=6"])
    return RLHFDataset(config.data.train_files, tokenizer, config.data)


def _trainer(dataset, overrides: list[str], plan) -> PPOTrainer:
    base = ["data.max_prompt_length=6", "data.max_response_length=2", "data.train_batch_size=4"]
    config = load_config(QUICKSTART, [*base, *overrides])
    runtime = SimpleNamespace(
        layout=ParallelLayout().resolve(1), dp_rank=0, world_size=1, rank=0, is_main=True, seed=1
    )
    batch = config.data.gen_batch_size or config.data.train_batch_size
    loader = PromptLoader(dataset, batch, shuffle=False, seed=0, pad_token_id=PAD)
    components = Components(
        tokenizer=SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD),
        hf_config=None,
        actor=None,
        ref=None,
        critic=None,
        rollout=ScriptedRollout(plan),
        reward_fn=score_first_token,
        val_reward_fn=score_first_token,
        train_loader=loader,
        val_loader=None,
    )
    return PPOTrainer(config, runtime, components)


VARIED, SAME = (LOW, HIGH), (LOW, LOW)
DAPO = [
    "rollout.n=2",
    "data.train_batch_size=4",
    "data.gen_batch_size=4",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
]
# Round 1 keeps groups 0 and 1, round 2 group 0, round 3 all four.
PLAN = [
    [VARIED, VARIED, SAME, SAME],
    [VARIED, SAME, SAME, SAME],
    [VARIED, VARIED, VARIED, VARIED],
]


def test_dynamic_sampling_keeps_groups_with_reward_variance_until_the_batch_is_full(dataset):
    trainer = _trainer(dataset, DAPO, PLAN)
    timing: dict[str, float] = {}
    batch, metrics = trainer._collect_batch(step=1, timing=timing)
    assert metrics == {"train/num_gen_batches": 3.0, "train/num_kept_groups": 7.0}
    uids = ["1-1-0", "1-1-0", "1-1-1", "1-1-1", "1-2-0", "1-2-0", "1-3-0", "1-3-0"]
    assert list(batch.non_tensor_batch["uid"]) == uids
    # Kept rows keep their own prompts (rounds 1, 1, 2, 3 draw prompts 0-3, 0-3, 4-7, 0-3).
    assert [info["index"] for info in batch.non_tensor_batch["extra_info"]] == [0, 0, 1, 1, 4, 4, 0, 0]
    assert batch.batch["token_level_scores"][:, 1].tolist() == [0.0, 1.0] * 4
    assert list(batch.non_tensor_batch["acc"]) == [0.0, 1.0] * 4
    assert set(timing) == {"gen", "reward"}
    assert [call["validate"] for call in trainer.rollout.calls] == [False] * 3


def test_dynamic_sampling_gives_up_after_max_num_gen_batches(dataset):
    trainer = _trainer(dataset, [*DAPO, "algorithm.filter_groups.max_num_gen_batches=2"], PLAN)
    with pytest.raises(RuntimeError, match=r"after 2 generation rounds .* only 3 of the 4 prompt groups"):
        trainer._collect_batch(step=1, timing={})


def test_without_filtering_one_round_is_the_batch(dataset):
    trainer = _trainer(dataset, ["rollout.n=2", "data.train_batch_size=4"], PLAN)
    batch, metrics = trainer._collect_batch(step=5, timing={})
    assert metrics == {} and len(batch) == 8 and batch.non_tensor_batch["uid"][-1] == "5-1-3"
    # The actor takes log-probs at the sampling temperature.
    assert batch.meta_info["temperature"] == 1.0 and "validate" not in batch.meta_info


def _advantage_batch() -> DataProto:
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    return DataProto.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.5], [1.0, 0.0]]),
            "old_log_probs": torch.full((4, 2), -1.0),
            "ref_log_prob": torch.full((4, 2), -1.1),
            "response_mask": mask,
        },
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )


def test_grpo_advantages_with_kl_in_reward_by_hand(dataset):
    overrides = [
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "rollout.n=2",
    ]
    trainer = _trainer(dataset, overrides, PLAN)
    batch = _advantage_batch()
    metrics = trainer._compute_advantages(batch)
    # kl = old - ref = 0.1 per token; rewards = scores - 0.1 * 0.1 on response tokens.
    expected_rewards = batch.batch["token_level_scores"] - 0.01 * batch.batch["response_mask"]
    assert torch.allclose(batch.batch["token_level_rewards"], expected_rewards)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.1, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    # Sequence rewards 0.98, -0.02 (group a) and 0.48, 0.99 (group b): each group of two is
    # +-(half the gap) / (unbiased std = gap / sqrt 2) = +-1/sqrt(2).
    s = 1 / math.sqrt(2)
    expected = torch.tensor([[s, s], [-s, -s], [-s, -s], [s, 0.0]])
    assert torch.allclose(batch.batch["advantages"], expected, atol=1e-5)


def test_remax_uses_greedy_baseline_from_the_rollout(dataset):
    # Sampled responses then the greedy baseline responses (one per prompt).
    plan = [[VARIED, VARIED, SAME, SAME], [(HIGH,), (LOW,), (LOW,), (HIGH,)]]
    trainer = _trainer(
        dataset, ["algorithm.adv_estimator=remax", "rollout.n=2", "data.train_batch_size=4"], plan
    )
    batch, _ = trainer._collect_batch(step=1, timing={})
    assert trainer.rollout.calls[1]["do_sample"] is False
    # one wake of the engine for both calls (it was woken and put to sleep for each)
    assert trainer.rollout.events == ["wake_weights", "sync", "wake", "gen", "gen", "sleep"]
    assert batch.batch["reward_baselines"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    trainer._compute_advantages(batch)
    # advantage = score - baseline on every response token
    assert batch.batch["advantages"][:, 0].tolist() == [-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, -1.0, -1.0]


def test_skipped_optimizer_steps_are_reported_and_averaged(dataset):
    trainer = _trainer(dataset, [], PLAN)
    printed: list[str] = []
    trainer.tracker = SimpleNamespace(print=printed.append)
    reduced = trainer._report_skips(
        "actor", {"actor/pg_loss": [1.0, 3.0], "actor/skipped_steps": 1.0}, step=7
    )
    assert reduced == {"actor/pg_loss": 2.0, "actor/skipped_steps": 1.0}
    assert printed == ["step 7: 1 actor optimizer step(s) skipped: non-finite loss or gradient norm"]
    assert trainer._report_skips("actor", {"actor/skipped_steps": 0.0}, step=8) == {
        "actor/skipped_steps": 0.0
    }
    assert len(printed) == 1


def test_rollout_phase_syncs_weights_once_per_actor_update(dataset):
    plan = [[VARIED] * 4] * 4
    trainer = _trainer(dataset, ["rollout.n=2", "data.train_batch_size=4"], plan)
    engine = trainer.rollout
    trainer._collect_batch(step=1, timing={})
    trainer._collect_batch(step=2, timing={})  # no actor update in between: no new copy
    trainer._weights_version += 1  # what train_step does after update_policy
    trainer._collect_batch(step=3, timing={})
    trainer._collect_batch(step=4, timing={})
    cycle = ["wake_weights", "wake", "gen", "sleep"]
    synced = ["wake_weights", "sync", "wake", "gen", "sleep"]
    assert engine.events == [*synced, *cycle, *synced, *cycle]
    # The sampling counter is what a checkpoint keeps, so a resumed run samples on.
    assert engine.state_dict() == {"calls": 4}
    restored = ScriptedRollout(plan)
    restored.load_state_dict(engine.state_dict())
    assert restored.state_dict() == {"calls": 4}


def test_offload_switches_park_and_restore_around_generation(dataset, monkeypatch):
    from verl_megatron.models import offload

    log: list[tuple[str, object]] = []
    for name in ("offload_optimizer", "load_optimizer", "offload_model", "load_model"):
        monkeypatch.setattr(
            offload.Offloader, name, lambda _, target, *a, _n=name, **k: log.append((_n, target))
        )
    overrides = [
        "rollout.n=2",
        "data.train_batch_size=4",
        "actor.megatron.optimizer_offload=true",
        "actor.megatron.param_offload=true",  # native engine: the actor's parameters must stay
    ]
    trainer = _trainer(dataset, overrides, [[VARIED] * 4])
    trainer.actor = SimpleNamespace(optimizer="actor-opt", chunks="actor-chunks")
    trainer._collect_batch(step=1, timing={})
    assert log == [("offload_optimizer", "actor-opt"), ("load_optimizer", "actor-opt")]


def test_colocated_memory_order_parks_training_state_before_the_engine_wakes(dataset, monkeypatch):
    """GPU order (issue 18): optimizer / reference / critic parked, engine weights woken, weights
    synced from the actor (still on the GPU), actor parked, then the KV cache; all back after."""
    from verl_megatron.models import offload

    trainer = None

    def record(name):
        return lambda _, target, *a, **k: trainer.rollout.events.append(f"{name}:{target}")

    for name in ("offload_optimizer", "load_optimizer", "offload_model", "load_model"):
        monkeypatch.setattr(offload.Offloader, name, record(name))
    monkeypatch.setattr(offload, "empty_device_cache", lambda: trainer.rollout.events.append("empty_cache"))
    overrides = [
        "rollout.n=2", "data.train_batch_size=4", "rollout.name=vllm",
        "actor.megatron.optimizer_offload=true", "actor.megatron.param_offload=true",
        "ref.megatron.param_offload=true", "critic.megatron.param_offload=true",
        "critic.megatron.optimizer_offload=true",
    ]  # fmt: skip
    trainer = _trainer(dataset, overrides, [[VARIED] * 4])
    trainer.actor = SimpleNamespace(optimizer="actor-opt", chunks="actor")
    trainer.ref = SimpleNamespace(chunks="ref")
    trainer.critic = SimpleNamespace(optimizer="critic-opt", chunks="critic")
    trainer._collect_batch(step=1, timing={})
    assert trainer.rollout.events == [
        "offload_optimizer:actor-opt", "offload_model:ref", "offload_model:critic",
        "offload_optimizer:critic-opt", "wake_weights", "sync", "offload_model:actor", "empty_cache",
        "wake", "gen", "sleep", "load_model:actor", "load_optimizer:critic-opt", "load_model:critic",
        "load_model:ref", "load_optimizer:actor-opt",
    ]  # fmt: skip


def test_contained_scorer_failures_reach_the_step_metrics(dataset):
    def flaky_scores(data: DataProto, return_dict: bool = False):
        result = score_first_token(data, return_dict=True)
        rows = len(data)
        # What the reward managers report per sample: 1 where the scorer timed out / raised.
        result["reward_extra_info"]["reward/timeout_count"] = [
            1.0 if i % 4 == 0 else 0.0 for i in range(rows)
        ]
        result["reward_extra_info"]["reward/error_count"] = [1.0 if i == 1 else 0.0 for i in range(rows)]
        return result if return_dict else result["reward_tensor"]

    trainer = _trainer(dataset, ["rollout.n=2", "data.train_batch_size=4"], [[VARIED] * 4])
    trainer.reward_fn = flaky_scores
    _, metrics = trainer._collect_batch(step=1, timing={})
    assert metrics == {"reward/timeout_count": 2.0, "reward/error_count": 1.0}
