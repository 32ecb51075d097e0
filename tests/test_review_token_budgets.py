"""A token budget (use_dynamic_bsz) that cannot hold the longest row is refused at start-up, with
the bound workers/batching.py applies at run time (budget x cp >= prompt + response tokens)."""

from __future__ import annotations

import os

import pytest

from verl_megatron.errors import ConfigError
from verl_megatron.trainer.config import load_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
SFT = os.path.join(ROOT, "configs", "sft.yaml")
LENGTHS = ["data.max_prompt_length=16", "data.max_response_length=4"]  # rows of up to 20 tokens
WHY = "(data.max_prompt_length + data.max_response_length = 16 + 4)"


def _validate(overrides: list[str], world_size: int = 1, path: str = QUICKSTART) -> None:
    validate_config(load_config(path, [*LENGTHS, *overrides]), world_size)


def _error(overrides: list[str], world_size: int = 1, path: str = QUICKSTART) -> str:
    with pytest.raises(ConfigError) as err:
        _validate(overrides, world_size, path)
    return str(err.value)


CRITIC = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8", "critic.use_dynamic_bsz=true"]
ROLES = {
    "actor.ppo_max_token_len_per_gpu": ["actor.use_dynamic_bsz=true"],
    "actor.ppo_infer_max_token_len_per_gpu": ["actor.use_dynamic_bsz=true"],
    "critic.ppo_max_token_len_per_gpu": CRITIC,
    "critic.ppo_infer_max_token_len_per_gpu": CRITIC,
    "ref.log_prob_max_token_len_per_gpu": ["actor.use_kl_loss=true", "ref.log_prob_use_dynamic_bsz=true"],
}


@pytest.mark.parametrize("key", list(ROLES))
def test_a_budget_below_the_longest_row_is_refused_at_start_up(key):
    assert _error([*ROLES[key], f"{key}=19"]) == (
        f"{key}=19 is less than the longest row this run can make, 20 tokens {WHY}: "
        f"a micro-batch holds whole rows; set {key} >= 20"
    )
    _validate([*ROLES[key], f"{key}=20"])  # exactly the longest row fits, as at run time
    _validate([f"{key}=1"])  # not read without a token budget


def test_context_parallel_ranks_hold_a_share_of_the_budget():
    key = "actor.ppo_max_token_len_per_gpu"
    cp = ["parallel.cp=2", "actor.use_dynamic_bsz=true"]
    assert _error([*cp, f"{key}=9"], world_size=2).startswith(
        f"{key}=9 (x cp=2: 18 tokens) is less than the longest row this run can make, 20 tokens"
    )
    assert _error([*cp, f"{key}=9"], world_size=2).endswith(f"set {key} >= 10")
    _validate([*cp, f"{key}=10"], world_size=2)
    # An async run's rollout rank (a one-rank layout) computing old log-probs holds whole rows.
    key = "actor.ppo_infer_max_token_len_per_gpu"
    separate = [
        "rollout.placement=separate",
        "rollout.world_size=1",
        "async_training.old_log_probs_on_rollout=true",
    ]
    assert _error([*cp, *separate, f"{key}=19"], world_size=3).endswith(f"set {key} >= 20")
    _validate([*cp, *separate, f"{key}=20"], world_size=3)


def test_sft_rows_are_bounded_by_sft_max_length():
    from verl_megatron.trainer.sft_trainer import prepare_sft

    key = "actor.ppo_max_token_len_per_gpu"
    overrides = ["quickstart.enable=true", "model.dtype=float32", "sft.max_length=64"]
    with pytest.raises(ConfigError) as err:
        prepare_sft(SFT, [*overrides, f"{key}=63"], 1)
    assert str(err.value) == (
        f"{key}=63 is less than the longest row this run can make, 64 tokens (sft.max_length=64): "
        f"a micro-batch holds whole rows; set {key} >= 64"
    )
    prepare_sft(SFT, [*overrides, f"{key}=64", "actor.ppo_infer_max_token_len_per_gpu=64"], 1)
