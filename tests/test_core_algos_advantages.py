"""Advantage estimators: hand-computed values, registry, invariances, NaN-free edge cases."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_megatron.trainer.ppo.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

EPS = 1e-6


def _outcome_rewards(
    scores: list[float], lengths: list[int], t: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score at the last valid token of each row (at column 0 for an empty row)."""
    rewards = torch.zeros(len(scores), t, dtype=torch.float64)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        rewards[i, max(length - 1, 0)] = score
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).double()
    return rewards, mask


def _per_row(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The (constant) value of each row on its unmasked tokens."""
    assert torch.equal(advantages * (1 - mask), torch.zeros_like(advantages))
    return [float(row[m.bool()][0]) if m.any() else 0.0 for row, m in zip(advantages, mask)]


def test_gae_returns_and_whitened_advantages() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.7, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)  # row 1 has a hole
    # row 0: A = [0.5, 0.8]; row 1: A_2 = 1 - 0.2 = 0.8, the hole passes V=0.2 and A=0.8 to t=0: 0.2 - 0.1 + 0.8
    raw = [0.5, 0.8, 0.9, 0.8]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    # before whitening the masked cells hold what the recursion carried: 0 at row 0's end, 0.8 in the hole
    carried = torch.tensor([[raw[0], raw[1], 0.0], [raw[2], raw[3], raw[3]]], dtype=torch.float64)
    verl_expected = (carried - mean) / math.sqrt(std**2 + 1e-8)  # verl 0.9.1 whitens every cell
    for zero_masked, expected in ((False, verl_expected), (True, verl_expected * mask)):
        advantages, returns = compute_gae_advantage_return(
            rewards, values, mask, gamma=1.0, lam=1.0, zero_masked=zero_masked
        )
        torch.testing.assert_close(returns[mask.bool()], torch.ones(4, dtype=torch.float64))
        torch.testing.assert_close(advantages, expected)
    # the default is verl's: masked cells are not 0
    default, _ = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(default, verl_expected)
    assert default[0, 2].item() == pytest.approx(-(mean) / math.sqrt(std**2 + 1e-8))


def test_gae_discounting() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    _, returns = compute_gae_advantage_return(
        rewards, torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3), 0.9, 0.8
    )
    # with V = 0: A_2 = 1, A_1 = (0.9 * 0.8) * 1, A_0 = 0.72^2
    torch.testing.assert_close(returns, torch.tensor([[0.72**2, 0.72, 1.0]], dtype=torch.float64))


def test_grpo_group_normalisation_and_dr_grpo() -> None:
    rewards, mask = _outcome_rewards([1, 0, 2, 1, 1, 1], [3, 2, 1, 3, 2, 3])
    index = np.array(["a", "a", "a", "b", "c", "c"], dtype=object)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index)
    assert adv is ret or torch.equal(adv, ret)
    # group a: mean 1, unbiased std 1; b: singleton (mean 0, std 1); c: equal scores -> 0
    assert _per_row(adv, mask) == pytest.approx([0, -1 / (1 + EPS), 1 / (1 + EPS), 1 / (1 + EPS), 0, 0])
    adv_dr, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert _per_row(adv_dr, mask) == pytest.approx([0, -1, 1, 1, 0, 0])


def test_grpo_index_forms_and_length_check() -> None:
    rewards, mask = _outcome_rewards([1, 0, 2], [1, 1, 1])
    for index in (["x", "y", "x"], np.array([7, 8, 7]), torch.tensor([7, 8, 7])):
        adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
        assert _per_row(adv, mask) == pytest.approx([-0.5, 0.0, 0.5])
    with pytest.raises(ValueError, match=r"index has 2 entries, expected one per row \(3\)"):
        compute_grpo_outcome_advantage(rewards, mask, ["x", "y"])


def test_grpo_passk() -> None:
    rewards, mask = _outcome_rewards([1, 0, 3, 5, 5], [2, 2, 2, 1, 1])
    index = ["a", "a", "a", "b", "b"]
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index)
    std_a = statistics.stdev([1, 0, 3])
    # only the best of each group: a -> (3 - 1) / std; b is a tie -> 0
    assert _per_row(adv, mask) == pytest.approx([0, 0, 2 / (std_a + EPS), 0, 0])
    cfg = {"norm_adv_by_std_in_grpo": False}  # config wins over the argument, as in verl
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, config=cfg)
    assert _per_row(adv, mask) == pytest.approx([0, 0, 2, 0, 0])
    with pytest.raises(ValueError, match="needs >= 2 samples per group"):
        compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "a", "b", "c"])


def test_rloo_leave_one_out() -> None:
    rewards, mask = _outcome_rewards([1, 0, 2, 5], [1, 2, 3, 1])
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    # s_i - mean of the others; a singleton keeps its score
    assert _per_row(adv, mask) == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5, 5])


def test_opo_length_weighted_baseline() -> None:
    rewards, mask = _outcome_rewards([2, 0, 4], [1, 3, 2])
    adv, _ = compute_opo_outcome_advantage(rewards, mask, ["a", "a", "b"])
    # group a baseline = (1 * 2 + 3 * 0) / 4 = 0.5; singleton b baseline 0
    assert _per_row(adv, mask) == pytest.approx([1.5, -0.5, 4.0])


def test_gpg_outcome_advantage() -> None:
    rewards, mask = _outcome_rewards([1, 0, 2, 3], [1, 1, 1, 1])
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, ["a", "a", "a", "b"])
    alpha = 4 / 3  # B / rows with a non-zero score
    assert _per_row(adv, mask) == pytest.approx([0, -alpha, alpha, 3 * alpha])
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, ["a", "a", "a", "b"], f_norm=2.0)
    assert _per_row(adv, mask) == pytest.approx([0, -alpha / 2, alpha / 2, 1.5 * alpha])


def test_reinforce_plus_plus_baseline() -> None:
    rewards, mask = _outcome_rewards([1, 0, 2], [2, 1, 1])
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ["a", "a", "a"])
    tokens = [0.0, 0.0, -1.0, 1.0]  # s - mean on every unmasked token, then whitened
    mean, std = statistics.mean(tokens), statistics.stdev(tokens)
    expected = torch.tensor(tokens, dtype=torch.float64).sub(mean).div(math.sqrt(std**2 + 1e-8))
    torch.testing.assert_close(adv[mask.bool()], expected)
    assert torch.equal(adv[~mask.bool()], torch.zeros(5, dtype=torch.float64))


def test_reinforce_plus_plus_discounted_returns() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, returns = compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=SimpleNamespace(gamma=0.5)
    )
    torch.testing.assert_close(
        returns, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], dtype=torch.float64)
    )
    valid = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean, std = statistics.mean(valid), statistics.stdev(valid)
    expected = torch.tensor(valid, dtype=torch.float64).sub(mean).div(math.sqrt(std**2 + 1e-8))
    torch.testing.assert_close(adv[mask.bool()], expected)
    with pytest.raises(ValueError, match=r"needs config\.gamma"):
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


def test_remax() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, returns = compute_remax_outcome_advantage(rewards, torch.tensor([0.5, 1.0]), mask)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(2, 1\)"):
        compute_remax_outcome_advantage(rewards, torch.zeros(2, 1), mask)


def test_registry() -> None:
    assert {e.value for e in AdvantageEstimator} == set(ADV_ESTIMATOR_REGISTRY)
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is compute_grpo_outcome_advantage
    assert get_adv_estimator_fn("remax") is compute_remax_outcome_advantage
    with pytest.raises(ValueError, match=r"Unknown advantage estimator simply: ppo; registered: \[.gae."):
        get_adv_estimator_fn("ppo")
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_adv_est("grpo")(lambda **kw: None)
    register_adv_est("grpo")(compute_grpo_outcome_advantage)  # re-registering the same function is fine


def test_shape_errors_name_the_function() -> None:
    with pytest.raises(ValueError, match=r"compute_rloo_outcome_advantage: token_level_rewards \(2, 3\)"):
        compute_rloo_outcome_advantage(torch.zeros(2, 3), torch.ones(2, 4), ["a", "b"])


OUTCOME_ESTIMATORS = [
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
]


@pytest.mark.parametrize("estimator", OUTCOME_ESTIMATORS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("lengths", [[0, 2, 3, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
def test_outcome_estimators_are_finite_with_singletons_and_empty_rows(estimator, lengths) -> None:
    rewards, mask = _outcome_rewards([1, 0, 3, 2], lengths)
    adv, ret = estimator(rewards, mask, ["a", "b", "b", "c"])
    assert adv.shape == ret.shape == mask.shape
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))


@pytest.mark.parametrize("lengths", [[0, 0], [1, 0], [3, 0]])
def test_token_estimators_are_finite_on_empty_masks(lengths) -> None:
    rewards, mask = _outcome_rewards([1.0, 2.0], lengths)
    values = torch.ones(2, 3, dtype=torch.float64)
    outputs = [
        compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95),
        compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 1.0}),
        compute_remax_outcome_advantage(rewards, torch.zeros(2, dtype=torch.float64), mask),
    ]
    for adv, ret in outputs:
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert torch.equal(adv * (1 - mask), torch.zeros_like(adv))


_scores = st.lists(st.integers(-5, 5).map(float), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None)
@given(group_a=_scores, group_b=_scores, seed=st.integers(0, 10_000), shift=st.integers(-3, 3))
def test_grpo_properties(group_a, group_b, seed, shift) -> None:
    scores = group_a + group_b
    index = ["a"] * len(group_a) + ["b"] * len(group_b)
    rewards, mask = _outcome_rewards(scores, [3] * len(scores))
    adv = compute_grpo_outcome_advantage(rewards, mask, index)[0][:, 0]
    # zero-sum within each group
    assert adv[: len(group_a)].sum().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[len(group_a) :].sum().item() == pytest.approx(0.0, abs=1e-6)
    # permuting rows permutes the advantages
    perm = torch.randperm(len(scores), generator=torch.Generator().manual_seed(seed))
    adv_perm = compute_grpo_outcome_advantage(rewards[perm], mask[perm], [index[i] for i in perm])[0][:, 0]
    torch.testing.assert_close(adv_perm, adv[perm])
    # shifting one group's scores by a constant changes nothing
    shifted = rewards.clone()
    shifted[: len(group_a), -1] += shift
    torch.testing.assert_close(compute_grpo_outcome_advantage(shifted, mask, index)[0][:, 0], adv)


@settings(max_examples=30, deadline=None)
@given(scores=_scores)
def test_rloo_properties(scores) -> None:
    rewards, mask = _outcome_rewards(scores, [1] * len(scores))
    adv = compute_rloo_outcome_advantage(rewards, mask, ["g"] * len(scores))[0][:, 0]
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-9)
    # RLOO = n / (n - 1) * (s - mean)
    n = len(scores)
    expected = (torch.tensor(scores, dtype=torch.float64) - statistics.mean(scores)) * n / (n - 1)
    torch.testing.assert_close(adv, expected)
