"""Async rollout ranks score their own batches (a function reward): the trainer stores what it
received, bit for bit what its own scoring would have stored; anything else stays on the trainer."""

import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_reward_managers import make_batch
from verl_megatron.reward.loading import compute_reward
from verl_megatron.trainer.async_trainer import rollout_scores, stored_rollout_scores
from verl_megatron.trainer.components import reward_fns
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.scoring import BatchScorer
from verl_megatron.utils.local_assets import build_char_tokenizer

QUICKSTART = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml"
)
SEPARATE = ["rollout.placement=separate", "rollout.world_size=1"]

ROWS = [  # (prompt, response, data source, ground truth): full, partial and zero scores, dict
    ("123", "321", "synthetic/reverse", "321"),  # scores with extra info, a contained failure
    ("4567", "7 6 5", "synthetic/reverse", "7654"),
    ("89", "12345678", "synthetic/reverse", "98"),
    ("x", "Answer: 42", "math_dapo", "42"),
    ("y", "Answer: 7", "math_dapo", "42"),
    ("z", "9", "synthetic/reverse", "not digits"),  # the scorer raises: counted, scored 0
]


@pytest.mark.parametrize("manager", ["naive", "dapo"])
def test_rollout_scores_equal_the_trainers_own_scoring(tmp_path, manager) -> None:
    config = load_config(QUICKSTART, [*SEPARATE, f"reward_model.reward_manager={manager}"])
    assert rollout_scores(config)
    tok = build_char_tokenizer(tmp_path / "tok")
    reward_fn = reward_fns(config, tok)[0]
    trainer_side, rollout_side = make_batch(tok, ROWS), make_batch(tok, ROWS)
    trainer_counts = BatchScorer(reward_fn, SimpleNamespace(world_size=1), None)(trainer_side)
    # the rollout's main rank scores the generated batch, which crosses to the trainer pickled
    rollout_side.meta_info["reward"] = compute_reward(rollout_side, reward_fn)
    received = pickle.loads(pickle.dumps(rollout_side))
    counts = stored_rollout_scores(received)
    assert "reward" not in received.meta_info
    ours, theirs = received.batch["token_level_scores"], trainer_side.batch["token_level_scores"]
    assert torch.equal(ours, theirs), f"max diff {float((ours - theirs).abs().max())}"
    assert float(theirs.abs().sum()) > 0 and counts == trainer_counts and counts["reward/error_count"] == 1.0
    assert sorted(received.non_tensor_batch) == sorted(trainer_side.non_tensor_batch)
    for key, values in trainer_side.non_tensor_batch.items():
        assert list(received.non_tensor_batch[key]) == list(values), key
    assert isinstance(received.non_tensor_batch["reward/error_count"], np.ndarray)


def test_a_batch_without_its_scores_is_refused(tmp_path) -> None:
    batch = make_batch(build_char_tokenizer(tmp_path / "tok"), ROWS[:2])
    with pytest.raises(RuntimeError, match="without its scores"):
        stored_rollout_scores(batch)


@pytest.mark.parametrize(
    "overrides, on_rollout",
    [
        ([], True),
        (["reward_model.reward_manager=batch"], True),
        (["reward_model.reward_manager=prime"], False),  # a process pool of its own
        (["reward_model.reward_manager=parallel"], False),
        (["reward_model.num_examine=1"], False),  # prints samples in the trainer's log
        (["custom_reward_function.path=/some/user/scorer.py"], False),  # user code: contained, on the trainer
        (["reward_model.enable=true"], False),  # a reward model lives on the trainer
        (["reward_model.judge.enable=true"], False),
    ],
)
def test_only_function_rewards_score_on_the_rollout(overrides, on_rollout) -> None:
    assert rollout_scores(load_config(QUICKSTART, [*SEPARATE, *overrides])) is on_rollout
