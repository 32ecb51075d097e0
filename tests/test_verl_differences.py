"""Where the trainer deliberately differs from verl 0.9.1, it asks for it explicitly.

The core_algos functions default to verl's numbers (tests in test_core_algos_*); these
tests pin that the trainer's own call sites pass the project's settings.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.config import AlgoConfig
from verl_megatron.trainer.ppo_trainer import PPOTrainer
from verl_megatron.workers.actor import _trainer_loss_config
from verl_megatron.workers.config import ActorConfig, PolicyLossConfig


def _actor_config(**policy_loss) -> ActorConfig:
    return ActorConfig(
        ppo_micro_batch_size_per_gpu=1, policy_loss=PolicyLossConfig(loss_mode="geo_mean", **policy_loss)
    )


def test_actor_uses_layout_invariant_geo_mean_unless_the_user_chose() -> None:
    unset = _actor_config()
    resolved = _trainer_loss_config(unset)
    assert resolved.policy_loss.geo_mean_valid_rows is True
    assert unset.policy_loss.geo_mean_valid_rows is None  # the user's config object is untouched
    assert dataclasses.replace(resolved, policy_loss=unset.policy_loss) == unset  # nothing else changed
    for chosen in (False, True):
        config = _actor_config(geo_mean_valid_rows=chosen)
        assert _trainer_loss_config(config) is config


def test_trainer_gae_advantages_are_zero_on_masked_cells() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    batch = DataProto.from_dict(
        tensors={
            "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
            "values": torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.7, 0.2]]),
            "response_mask": mask,
        },
        non_tensors={"uid": np.array(["a", "b"], dtype=object)},
    )
    fake = SimpleNamespace(
        config=SimpleNamespace(algorithm=AlgoConfig(adv_estimator="gae")), kl_ctrl=None, teacher=None
    )
    PPOTrainer._compute_advantages(fake, batch)
    advantages = batch.batch["advantages"]
    assert torch.equal(advantages * (1 - mask), torch.zeros_like(advantages))
    assert advantages[mask.bool()].abs().min() > 0.1  # whitened values survive on the response tokens
