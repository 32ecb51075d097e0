"""actor.recompute_old_log_prob=false: an on-policy update takes its own log-probs as the old ones.

With bitwise parity on, a separate old-log-prob pass and the update's own forward give the same
bits, so skipping the pass must leave every actor metric bit-identical while the actor computes
log-probs zero times instead of once a step. Layouts where old log-probs are read before the
update (several mini-batches or epochs, KL in the reward, rollout correction) are refused at
start-up.
"""

from __future__ import annotations

import functools

import pytest

from tests.helpers import run_per_variant
from tests.test_rollout_parity import trainer_job  # noqa: F401  (the pool imports it from here)

ONE_MINI_BATCH = ["actor.ppo_mini_batch_size=4"]  # = data.train_batch_size of the parity quickstart


@pytest.fixture(scope="module")
def runs(pool1, tmp_path_factory) -> dict:
    variants = {r: [*ONE_MINI_BATCH, f"actor.recompute_old_log_prob={str(r).lower()}"] for r in (True, False)}
    folder = functools.partial(tmp_path_factory.mktemp, "on_policy")
    return run_per_variant(pool1, f"{__name__}:trainer_job", folder, variants)


def test_skipping_the_pass_trains_bit_for_bit_the_same(runs):
    plain, skipped = runs[True], runs[False]
    assert plain["log_prob_calls"] == 2 and skipped["log_prob_calls"] == 0
    assert all("timing_s/old_log_prob" in r for r in plain["rows"])
    assert not any("timing_s/old_log_prob" in r for r in skipped["rows"])
    assert plain["rows"][1]["actor/grad_norm"] > 0  # a real update
    compared = 0
    for row_plain, row_skipped in zip(plain["rows"], skipped["rows"], strict=True):
        for key, value in row_plain.items():
            if key.startswith(("actor/", "response_length/", "critic/score")):
                assert row_skipped[key] == value, (row_plain["step"], key, value, row_skipped[key])
                compared += 1
    assert compared > 20


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("actor.ppo_epochs=2", r"actor\.ppo_epochs=2"),
        ("actor.ppo_mini_batch_size=2", r"actor\.ppo_mini_batch_size=2 is not data\.train_batch_size=4"),
        ("algorithm.use_kl_in_reward=true", r"algorithm\.use_kl_in_reward=true"),
        ("algorithm.rollout_correction.rollout_is=token", r"algorithm\.rollout_correction"),
    ],
)
def test_refused_where_old_log_probs_are_read_before_the_update(override, named):
    from tests.test_e2e import QUICKSTART
    from tests.test_rollout_parity import QUICKSTART_PARITY
    from verl_megatron.errors import UserInputError
    from verl_megatron.trainer.config import load_config, validate_config

    overrides = [*QUICKSTART_PARITY, *ONE_MINI_BATCH, "actor.recompute_old_log_prob=false"]
    validate_config(load_config(QUICKSTART, overrides), 1)
    with pytest.raises(
        UserInputError, match=r"actor\.recompute_old_log_prob=false needs an on-policy update.*" + named
    ):
        validate_config(load_config(QUICKSTART, [*overrides, override]), 1)
