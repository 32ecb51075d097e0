"""Rollout correction (verl's rollout_corr_helper): IS weights, rejection masks, their
metrics and bypass mode, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo import rollout_corr_helper as rc

LN = math.log
# one row of three tokens (the third is padding) with ratios pi_train / pi_rollout 0.5, 3, (5)
LOG_RATIO = torch.tensor([[LN(0.5), LN(3.0), LN(5.0)]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)


def test_token_is_weights_truncated_and_their_metrics() -> None:
    weights, m = rc.compute_rollout_correction_weights(LOG_RATIO, MASK, "token", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 2.0, 0.0]], dtype=torch.float64))
    assert m["rollout_is_mean"] == pytest.approx(1.25)
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((2.0, 0.5))
    # raw 3 > 2 is high; lower bound defaults to 1 / 2 and raw 0.5 is not below it
    # masked means divide by count + 1e-8, as verl's
    assert (m["rollout_is_ratio_fraction_high"], m["rollout_is_ratio_fraction_low"]) == pytest.approx(
        (0.5, 0.0)
    )
    assert m["rollout_is_std"] == pytest.approx(0.75)
    # ESS = 1 / mean((w / mean w)^2) = 1 / ((0.16 + 2.56) / 2)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 1.36, rel=1e-6)
    assert m["rollout_is_seq_fraction_high"] == 0.0  # raw row mean (0.5 + 3) / 2 = 1.75


def test_icepop_zeroes_weights_outside_the_band() -> None:
    weights, m = rc.compute_rollout_correction_weights(LOG_RATIO, MASK, "token", "0.6_2.5")
    torch.testing.assert_close(weights, torch.zeros(1, 3, dtype=torch.float64))
    assert m["rollout_is_oob_ratio"] == pytest.approx(1.0)
    assert m["rollout_is_eff_sample_size"] == 0.0  # no weight left (verl divides by zero here)
    weights, m = rc.compute_rollout_correction_weights(LOG_RATIO, MASK, "token", "0.4_2.5")
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.0, 0.0]], dtype=torch.float64))
    assert m["rollout_is_oob_ratio"] == pytest.approx(0.5)


def test_sequence_is_weights_and_batch_normalisation() -> None:
    log_ratio = torch.tensor([[LN(2.0), LN(1.5)], [LN(0.5), 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    weights, m = rc.compute_rollout_correction_weights(log_ratio, mask, "sequence", 5.0)
    torch.testing.assert_close(weights, torch.tensor([[3.0, 3.0], [0.5, 0.5]], dtype=torch.float64))
    assert m["rollout_is_max"] == pytest.approx(3.0) and m["rollout_is_min"] == pytest.approx(0.5)
    normed, m = rc.compute_rollout_correction_weights(log_ratio, mask, "sequence", 5.0, True)
    torch.testing.assert_close(normed, weights / 1.75)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.75)


def test_rejection_options_and_their_combination() -> None:
    log_ratio = torch.tensor([[LN(2.0), 0.1], [0.05, -0.05]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    # token_k2: x^2 / 2 = 0.24 (> 0.1, rejected), 0.005, 0.00125, 0.00125
    kept, m = rc.compute_rollout_rejection_mask(log_ratio, mask, "token_k2", 0.1)
    torch.testing.assert_close(kept, torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    assert m["rollout_rs_token_k2_masked_fraction"] == pytest.approx(0.25)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    # seq_mean_k1 keeps rows whose mean of -x lies in [log 0.8, log 1.25]: row 0's is -0.397
    kept, m = rc.compute_rollout_rejection_mask(log_ratio, mask, "seq_mean_k1", "0.8_1.25")
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert m["rollout_rs_seq_mean_k1_mean"] == pytest.approx(-(LN(2.0) + 0.1) / 4)
    # both must pass; thresholds given one per option
    kept, _ = rc.compute_rollout_rejection_mask(log_ratio, mask, "token_k2,seq_max_k3", "0.1,0.003")
    # seq_max_k3: row 1's max k3 is exp(0.05) - 1.05 = 0.00127 <= 0.003, row 0's is 0.307
    torch.testing.assert_close(kept, torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))


def test_threshold_errors_are_one_line_and_name_the_option() -> None:
    ones = torch.ones(1, 2)
    with pytest.raises(TypeError, match="not a boolean"):
        rc.compute_rollout_correction_weights(ones, ones, "token", True)
    with pytest.raises(ValueError, match="Invalid rollout_rs option: token_k4"):
        rc.compute_rollout_rejection_mask(ones, ones, "token_k4", 1.0)
    with pytest.raises(ValueError, match="'seq_sum_k2' must be a single upper bound"):
        rc.compute_rollout_rejection_mask(ones, ones, "seq_sum_k2", "0.1_2")
    with pytest.raises(ValueError, match="2 values for 3 rollout_rs options"):
        rc.compute_rollout_rejection_mask(ones, ones, "token_k1,token_k2,token_k3", "2,3")
    with pytest.raises(ValueError, match="at least one valid token"):
        rc.compute_rollout_correction_and_rejection_mask(ones, ones, torch.zeros(1, 2), "token")


def test_offpolicy_metrics() -> None:
    train = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.float64)
    rollout = torch.tensor([[LN(0.25), LN(0.25)]], dtype=torch.float64)
    m = rc.compute_offpolicy_metrics(train, rollout, torch.ones(1, 2))
    assert m["kl"] == pytest.approx(-LN(2.0) / 2)
    assert m["training_ppl"] == pytest.approx(math.sqrt(8.0))  # exp(-(log .5 + log .25) / 2)
    assert m["rollout_ppl"] == pytest.approx(4.0)
    assert m["chi2_token"] == pytest.approx((4.0 + 1.0) / 2 - 1.0)
    assert m["chi2_seq"] == pytest.approx(3.0)  # (2 * 1)^2 - 1
    assert m["k3_kl"] == pytest.approx((2.0 - LN(2.0) - 1.0) / 2)


def test_add_to_batch_and_bypass_mode() -> None:
    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": LOG_RATIO.float(),
            "rollout_log_probs": torch.zeros(1, 3),
            "response_mask": MASK.float(),
        }
    )
    config = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": 2.5,
    }
    batch, metrics = rc.compute_rollout_correction_and_add_to_batch(batch, config)
    # token_k1 keeps -x in [log 0.4, log 2.5]: ratio 3 (-x = -1.1) is rejected
    torch.testing.assert_close(batch.batch["response_mask"], torch.tensor([[1.0, 0.0, 0.0]]))
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor([[0.5, 2.0, 0.0]]))
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.25)
    policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    OmegaConf.set_struct(policy_loss, True)
    rc.apply_bypass_mode(batch, {"loss_type": "reinforce"}, policy_loss)
    assert policy_loss.loss_mode == "bypass_mode" and policy_loss.rollout_correction.loss_type == "reinforce"
    torch.testing.assert_close(batch.batch["old_log_probs"], torch.zeros(1, 3))
    with pytest.raises(ValueError, match="requires rollout_log_probs"):
        rc.apply_bypass_mode(DataProto.from_dict(tensors={"x": torch.zeros(1, 1)}), {}, policy_loss)
