"""KL estimators (values, clamps, straight-through gradients), KL controllers,
KL-in-reward, value and entropy losses, masked reductions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from verl_megatron.trainer.ppo.core_algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty_to_rewards,
    compute_entropy_loss,
    compute_rewards,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
)

LOGPROB = torch.tensor([-1.0, -2.0], dtype=torch.float64)
REF = torch.tensor([-1.5, -1.0], dtype=torch.float64)  # d = logprob - ref = [0.5, -1.0]
K3 = [math.exp(-0.5) + 0.5 - 1, math.e - 2]  # exp(x) - x - 1 with x = ref - logprob = [-0.5, 1]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("kl", "k1"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("mse", "k2", "k2+", "mse+"), [0.125, 0.5]),
        (("low_var_kl", "k3"), K3),
    ],
)
def test_kl_penalty_values(names, expected) -> None:
    for name in names:
        torch.testing.assert_close(
            kl_penalty(LOGPROB, REF, name), torch.tensor(expected, dtype=torch.float64)
        )


def test_k3_clamps() -> None:
    logprob = torch.tensor([0.0, -30.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-30.0, 0.0, -1.0], dtype=torch.float64)
    # x = ref - logprob is clamped to [-20, 20]; exp(-20) + 20 - 1 = 19 and exp(20) - 21 are clipped to 10
    torch.testing.assert_close(
        kl_penalty(logprob, ref, "k3"), torch.tensor([10.0, 10.0, 0.0], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("name", "base"), [("k3+", "k3"), ("low_var_kl+", "low_var_kl"), ("k1+", "k1"), ("abs+", "abs")]
)
def test_straight_through_forms_have_estimator_value_and_k2_gradient(name: str, base: str) -> None:
    logprob = LOGPROB.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    value = kl_penalty(logprob, ref, name)
    torch.testing.assert_close(value.detach(), kl_penalty(LOGPROB, REF, base))
    value.sum().backward()
    d = LOGPROB - REF
    torch.testing.assert_close(logprob.grad, d)  # d/dlogprob of d^2 / 2
    torch.testing.assert_close(ref.grad, -d)


def test_plain_k3_gradient_differs_from_k2() -> None:
    logprob = LOGPROB.clone().requires_grad_(True)
    kl_penalty(logprob, REF, "k3").sum().backward()
    torch.testing.assert_close(logprob.grad, 1 - torch.exp(REF - LOGPROB))


@pytest.mark.parametrize(
    ("name", "message"), [("full", "full-vocabulary"), ("full+", "full-vocabulary"), ("k4", "'k4'")]
)
def test_kl_penalty_unsupported(name: str, message: str) -> None:
    with pytest.raises(NotImplementedError, match=message):
        kl_penalty(LOGPROB, REF, name)


def test_adaptive_kl_controller() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    before = ctrl.value
    ctrl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctrl.value == pytest.approx(before * (1 - 0.1 * 100 / 10_000))
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 6.0, 0)


def test_get_kl_controller() -> None:
    fixed = get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.05))
    fixed.update(current_kl=100.0, n_steps=10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=50))
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.1, 50)
    with pytest.raises(NotImplementedError, match="'pid'"):
        get_kl_controller(SimpleNamespace(type="pid", kl_coef=0.1))


def test_compute_rewards() -> None:
    scores = torch.tensor([[0.0, 1.0]])
    out = compute_rewards(scores, torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.5]]), kl_ratio=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.05]]))


def test_apply_kl_penalty_to_rewards() -> None:
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.3, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_penalty_to_rewards(scores, old, ref, mask, ctrl, "kl")
    expected = torch.tensor([[-0.1, -0.2, 0.7], [-0.05, 1.85, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    # batch mean of per-row means (0.4, 0.2); beta reported before the update
    assert metrics == pytest.approx({"actor/reward_kl_penalty": 0.3, "actor/reward_kl_penalty_coeff": 0.5})
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # error clipped to 0.2, n_steps = B = 2


VPREDS = torch.tensor([[1.0, 2.0, 0.0, 5.0]], dtype=torch.float64)
VALUES = torch.tensor([[0.5, 2.5, 0.0, 0.0]], dtype=torch.float64)
RETURNS = torch.tensor([[2.0, 1.0, 0.0, 100.0]], dtype=torch.float64)
VMASK = torch.tensor([[1, 1, 1, 0]])


def test_value_loss_clipping() -> None:
    # t0: v_clip = 0.7 -> max(1, 1.69); t1: v_clip = 2.3 -> max(1, 1.69); t2: 0; t3 masked
    vf_loss, clipfrac = compute_value_loss(VPREDS, RETURNS, VALUES, VMASK, cliprange_value=0.2)
    assert vf_loss.item() == pytest.approx(0.5 * 3.38 / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)
    global_loss, _ = compute_value_loss(VPREDS, RETURNS, VALUES, VMASK, 0.2, dp_size=2, batch_num_tokens=4)
    assert global_loss.item() == pytest.approx(0.5 * 3.38 / 4 * 2)
    seq_loss, _ = compute_value_loss(VPREDS, RETURNS, VALUES, VMASK, 0.2, loss_agg_mode="seq-mean-token-sum")
    assert seq_loss.item() == pytest.approx(0.5 * 3.38)


def test_value_loss_gradient_and_shape_check() -> None:
    vpreds = VPREDS.clone().requires_grad_(True)
    compute_value_loss(vpreds, RETURNS, VALUES, VMASK, cliprange_value=10.0)[0].backward()
    # no clipping with a wide range: d/dv 0.5 * mean (v - R)^2 = (v - R) / 3
    torch.testing.assert_close(vpreds.grad, torch.tensor([[-1 / 3, 1 / 3, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"compute_value_loss: returns has shape \(1, 3\)"):
        compute_value_loss(VPREDS, RETURNS[:, :3], VALUES, VMASK, 0.2)


def test_entropy() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]]], dtype=torch.float64)
    p = [0.25, 0.75]
    expected = torch.tensor([[math.log(4.0), -sum(q * math.log(q) for q in p)]], dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    loss = compute_entropy_loss(logits, torch.tensor([[1, 1]]), "token-mean")
    assert loss.item() == pytest.approx(expected.mean().item())
    assert compute_entropy_loss(logits, torch.tensor([[0, 1]])).item() == pytest.approx(expected[0, 1].item())
    with pytest.raises(ValueError, match=r"logits \(1, 2, 4\) do not match response_mask \(1, 3\)"):
        compute_entropy_loss(logits, torch.ones(1, 3))


def test_masked_reductions() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, float("nan")], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_var(values, mask).item() == pytest.approx(1.0)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(2 / 3)
    whitened = masked_whiten(values, mask)[:3]
    torch.testing.assert_close(
        whitened, torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / math.sqrt(1 + 1e-8)
    )
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False)[:3], whitened + 2.0)
    rows = torch.tensor([[1.0, 3.0], [5.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(
        masked_mean(rows, torch.tensor([[1, 1], [1, 0]]), axis=-1),
        torch.tensor([2.0, 5.0], dtype=torch.float64),
    )


@pytest.mark.parametrize("mask", [[0, 0, 0], [0, 1, 0]])
def test_masked_reductions_are_finite_with_fewer_than_two_elements(mask) -> None:
    values = torch.tensor([4.0, 7.0, -1.0], dtype=torch.float64)
    mask = torch.tensor(mask)
    assert masked_var(values, mask).item() == 0.0
    whitened = masked_whiten(values, mask)
    assert torch.isfinite(whitened).all()
    assert torch.equal(whitened * mask, torch.zeros(3, dtype=torch.float64))
    assert masked_mean(values, torch.zeros(3)).item() == 0.0
