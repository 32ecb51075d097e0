"""Policy losses: hand-computed values, gradients, config handling and the registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl_megatron.trainer.ppo.core_algos import (
    POLICY_LOSS_REGISTRY,
    compute_policy_loss,
    get_policy_loss_fn,
    register_policy_loss,
)

LN = math.log


@dataclass
class PolicyLossCfg:
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    dro_beta: float = 0.1
    geo_mean_valid_rows: bool | None = None


@dataclass
class ActorCfg:
    """The verl actor fields the losses read."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    policy_loss: PolicyLossCfg = field(default_factory=PolicyLossCfg)
    global_batch_info: dict = field(default_factory=dict)


# Four PPO cases (clip 0.2, dual clip 3) and a masked fifth token holding garbage:
#   A=+1 r=1.5 -> clipped to 1.2: -1.2 (clipfrac)
#   A=-1 r=0.5 -> clipped to 0.8: +0.8 (clipfrac)
#   A=-1 r=4   -> unclipped 4, dual-clipped to 3: +3 (clipfrac_lower)
#   A=+2 r=1   -> -2
OLD = torch.zeros(1, 5, dtype=torch.float64)
LOG_RATIO = torch.tensor([[LN(1.5), LN(0.5), LN(4.0), 0.0, 50.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0, -1.0, -1.0, 2.0, -7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_compute_policy_loss_vanilla_and_dual_clip() -> None:
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        OLD, OLD + LOG_RATIO, ADV, MASK, cliprange=0.2, clip_ratio_c=3.0
    )
    assert pg_loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 2.0) / 4)
    assert clipfrac.item() == pytest.approx(0.5)
    assert clipfrac_lower.item() == pytest.approx(0.25)
    assert ppo_kl.item() == pytest.approx(-LN(1.5 * 0.5 * 4.0) / 4)


def test_compute_policy_loss_clip_higher_and_modes() -> None:
    pg_loss, *_ = compute_policy_loss(OLD, OLD + LOG_RATIO, ADV, MASK, cliprange_low=0.2, cliprange_high=0.28)
    assert pg_loss.item() == pytest.approx((-1.28 + 0.8 + 3.0 - 2.0) / 4)
    # token-sum of the same per-token losses
    pg_sum, *_ = compute_policy_loss(
        OLD, OLD + LOG_RATIO, ADV, MASK, cliprange=0.2, loss_agg_mode="token-sum"
    )
    assert pg_sum.item() == pytest.approx(0.6)


def test_compute_policy_loss_gradient_only_through_unclipped_tokens() -> None:
    log_prob = (OLD + LOG_RATIO).requires_grad_(True)
    compute_policy_loss(OLD, log_prob, ADV, MASK, cliprange=0.2)[0].backward()
    # d(-A r)/d log_prob = -A r / N on the unclipped token only (N = 4)
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([[0.0, 0.0, 0.0, -2.0 / 4, 0.0]], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cliprange": 0.2, "clip_ratio_c": 1.0}, "clip_ratio_c > 1.0"),
        ({}, "pass cliprange"),
    ],
)
def test_compute_policy_loss_rejects_bad_clip_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        compute_policy_loss(OLD, OLD, ADV, MASK, **kwargs)


def test_compute_policy_loss_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 4\)"):
        compute_policy_loss(OLD, OLD, ADV[:, :4], MASK, cliprange=0.2)


@pytest.mark.parametrize(
    "config",
    [
        ActorCfg(),
        SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None),  # no clip_ratio_c: 3.0
        OmegaConf.structured(ActorCfg()),
        OmegaConf.create({"clip_ratio": 0.1, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2}),
    ],
)
def test_vanilla_registry_matches_functional_form(config) -> None:
    loss, metrics = get_policy_loss_fn("vanilla")(OLD, OLD + LOG_RATIO, ADV, MASK, "token-mean", config)
    assert loss.item() == pytest.approx(0.15)
    assert metrics == pytest.approx(
        {"actor/pg_clipfrac": 0.5, "actor/ppo_kl": -LN(3.0) / 4, "actor/pg_clipfrac_lower": 0.25}
    )


def test_vanilla_rollout_is_weights_and_global_batch_info() -> None:
    weights = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    fn = get_policy_loss_fn("vanilla")
    loss, _ = fn(OLD, OLD + LOG_RATIO, ADV, MASK, "token-mean", ActorCfg(), weights)
    assert loss.item() == pytest.approx((-2.4 + 0.8 + 3.0 - 2.0) / 4)
    # Global counts from config.global_batch_info (verl 0.9) or from the keyword (which wins).
    cfg = ActorCfg(global_batch_info={"dp_size": 2, "batch_num_tokens": 8})
    assert fn(OLD, OLD + LOG_RATIO, ADV, MASK, "token-mean", cfg)[0].item() == pytest.approx(0.6 / 8 * 2)
    info = {"dp_size": 4, "batch_num_tokens": 16, "global_batch_size": 4}
    assert fn(OLD, OLD + LOG_RATIO, ADV, MASK, "token-mean", cfg, global_batch_info=info)[0].item() == (
        pytest.approx(0.6 / 16 * 4)
    )
    with pytest.raises(ValueError, match=r"unknown keys \['dp'\]"):
        fn(OLD, OLD, ADV, MASK, "token-mean", ActorCfg(), global_batch_info={"dp": 2})


def test_gspo_sequence_ratio_and_token_gradient() -> None:
    # row 0: log-ratios 0.05, 0.05, A=+1 -> s = e^0.05, unclipped; row 1: one token, s = e^-0.5, A=-1 -> 0.8
    old = torch.zeros(2, 2, dtype=torch.float64)
    log_prob = torch.tensor([[0.05, 0.05], [-0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = get_policy_loss_fn("gspo")(old, log_prob, adv, mask, "seq-mean-token-mean", ActorCfg())
    assert loss.item() == pytest.approx((-math.exp(0.05) + 0.8) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # each token's gradient is its own -A s_i, averaged within the row (1/2) and over rows (1/2)
    expected = torch.tensor([[-math.exp(0.05) / 4, -math.exp(0.05) / 4], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(log_prob.grad, expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # token values -e^0.05, -e^0.05, 0.8 over 3 tokens / summed / per-row means averaged
        ("token-mean", (-2 * math.exp(0.05) + 0.8) / 3),
        ("token-sum", -2 * math.exp(0.05) + 0.8),
        ("seq-mean-token-mean", (-math.exp(0.05) + 0.8) / 2),
        ("seq-mean-token-sum", (-2 * math.exp(0.05) + 0.8) / 2),
    ],
)
def test_gspo_honours_loss_agg_mode(mode: str, expected: float) -> None:
    # verl 0.9.1: GSPO aggregates with the requested mode (<= 0.9.0 forced seq-mean-token-mean)
    old = torch.zeros(2, 2, dtype=torch.float64)
    log_prob = torch.tensor([[0.05, 0.05], [-0.5, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = get_policy_loss_fn("gspo")(old, log_prob, adv, mask, mode, ActorCfg())
    assert loss.item() == pytest.approx(expected)


def test_sapo_gate_value_and_gradient_on_policy() -> None:
    old = torch.zeros(2, 1, dtype=torch.float64)
    log_prob = torch.zeros(2, 1, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    loss, metrics = get_policy_loss_fn("sapo")(old, log_prob, adv, torch.ones(2, 1), "token-mean", ActorCfg())
    # gate(1) = sigmoid(0) * 4 / tau = 2 / tau: tau_pos = 1 for A > 0, tau_neg = 1.05 for A < 0
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2)
    assert metrics["actor/pg_clipfrac"] == 0.0
    loss.backward()
    # d gate / d r at r = 1 is 4 * sigmoid'(0) = 1 for any tau: the on-policy gradient is -A / rows
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.5], [0.5]], dtype=torch.float64))


def test_gpg_policy_loss() -> None:
    log_prob = torch.tensor([[-1.0, -2.0, -5.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 3.0, 100.0]], dtype=torch.float64)
    loss, metrics = get_policy_loss_fn("gpg")(
        log_prob, log_prob, adv, torch.tensor([[1, 1, 0]]), "token-mean", None
    )
    assert loss.item() == pytest.approx((1.0 + 6.0) / 2)
    assert metrics == {}


def test_cispo_keeps_gradient_of_clipped_tokens() -> None:
    old = torch.tensor([[-1.0 - LN(2.0), -2.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    cfg = ActorCfg(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics = get_policy_loss_fn("cispo")(old, log_prob, adv, torch.ones(1, 2), "token-mean", cfg)
    assert loss.item() == pytest.approx((1.28 * 1.0 + 1.0 * 2.0) / 2)  # ratio 2 -> 1.28, ratio 1
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.64, -0.5]], dtype=torch.float64))


def test_geo_mean_sequence_ratio() -> None:
    old = torch.zeros(3, 2, dtype=torch.float64)
    log_prob = torch.tensor([[0.1, 0.3], [-0.4, 7.0], [1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])  # row 2 is padding
    # row 0: log-ratios clipped to (0.1, 0.2) -> exp(0.15); row 1: -0.4 clipped to -0.2 (pessimistic for A < 0)
    row_sum = -math.exp(0.15) + math.exp(-0.2)
    fn = get_policy_loss_fn("geo_mean")
    # default = verl 0.9.1: the empty row counts in the mean (as a 0), global counts are ignored
    for info in ({}, {"dp_size": 2, "global_batch_size": 8}):
        loss, metrics = fn(old, log_prob, adv, mask, "token-mean", ActorCfg(), global_batch_info=info)
        assert loss.item() == pytest.approx(row_sum / 3), info
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    # geo_mean_valid_rows (the trainer's default): only the 2 rows with tokens, or the global counts
    cfg = ActorCfg(policy_loss=PolicyLossCfg(geo_mean_valid_rows=True))
    assert fn(old, log_prob, adv, mask, "token-mean", cfg)[0].item() == pytest.approx(row_sum / 2)
    info = {"dp_size": 2, "global_batch_size": 8}
    loss = fn(old, log_prob, adv, mask, "token-mean", cfg, global_batch_info=info)[0]
    assert loss.item() == pytest.approx(row_sum / 8 * 2)


# cov_t = (A - mean A)(lp - mean lp) = [3, 0.5, 0, 0]: only token 0 lies in (1, 5)
COV_LP = torch.tensor([[-1.0, -3.0, -2.0, -2.0]], dtype=torch.float64)
COV_ADV = torch.tensor([[3.0, -0.5, -1.25, -1.25]], dtype=torch.float64)


def test_clip_cov_drops_the_high_covariance_token() -> None:
    log_prob = COV_LP.clone().requires_grad_(True)
    loss, metrics = get_policy_loss_fn("clip_cov")(
        COV_LP, log_prob, COV_ADV, torch.ones(1, 4), "token-mean", ActorCfg()
    )
    assert loss.item() == pytest.approx((0.0 + 0.5 + 1.25 + 1.25) / 4)
    assert metrics == pytest.approx({"actor/pg_clipfrac": 0.25, "actor/ppo_kl": 0.0})
    loss.backward()
    torch.testing.assert_close(
        log_prob.grad, torch.tensor([[0.0, 0.125, 0.3125, 0.3125]], dtype=torch.float64)
    )


def test_clip_cov_draws_at_most_clip_num_candidates() -> None:
    adv = torch.tensor([[3.0, -3.0, 0.0, 0.0]], dtype=torch.float64)  # cov = [3, 3, 0, 0]: two candidates
    torch.manual_seed(0)
    loss, metrics = get_policy_loss_fn("clip_cov")(
        COV_LP, COV_LP, adv, torch.ones(1, 4), "token-mean", ActorCfg()
    )
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)  # clip_num = max(1, int(2e-4 * 4)) = 1
    assert loss.item() in (pytest.approx(3.0 / 4), pytest.approx(-3.0 / 4))


def test_kl_cov_penalises_the_top_covariance_token() -> None:
    old = COV_LP - torch.tensor([[0.1, 0.0, 0.0, 0.5]], dtype=torch.float64)
    cfg = ActorCfg(policy_loss=PolicyLossCfg(ppo_kl_coef=1.0))
    loss, metrics = get_policy_loss_fn("kl_cov")(old, COV_LP, COV_ADV, torch.ones(1, 4), "token-mean", cfg)
    per_token = [-3 * math.exp(0.1) + 0.1, 0.5, 1.25, 1.25 * math.exp(0.5)]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    assert metrics == pytest.approx({"actor/ppo_kl": 0.6 / 4})


# bypass_mode computes rollout-correction statistics, which (as in verl) refuse a batch
# without any valid token: see test_bypass_mode_refuses_empty_mask.
@pytest.mark.parametrize("name", sorted(set(POLICY_LOSS_REGISTRY) - {"bypass_mode"}))
def test_every_policy_loss_is_finite_with_zero_grad_on_empty_mask(name: str) -> None:
    old = torch.randn(3, 4, dtype=torch.float64)
    log_prob = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss, metrics = get_policy_loss_fn(name)(
        old,
        log_prob,
        torch.randn(3, 4),
        torch.zeros(3, 4),
        "token-mean",
        ActorCfg(),
        global_batch_info={"robust": True},  # what the trainer's actor passes
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(log_prob.grad, torch.zeros(3, 4, dtype=torch.float64))
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean"])
def test_policy_loss_on_empty_mask_defaults_to_verls_number(name: str) -> None:
    """verl 0.9.1: token-mean of an all-masked batch is 0/0 = NaN; geo_mean is a mean of 0-losses = 0."""
    old = torch.randn(3, 4, dtype=torch.float64)
    loss, _ = get_policy_loss_fn(name)(
        old, old + 0.1, torch.randn(3, 4), torch.zeros(3, 4), "token-mean", ActorCfg()
    )
    assert loss.item() == 0.0 if name == "geo_mean" else math.isnan(loss.item())


def test_registry_lookup_and_custom_registration() -> None:
    assert set(POLICY_LOSS_REGISTRY) >= {
        "vanilla",
        "gspo",
        "sapo",
        "gpg",
        "clip_cov",
        "kl_cov",
        "geo_mean",
        "cispo",
    }
    with pytest.raises(
        ValueError, match=r"Unsupported loss mode: 'nope'. Supported modes are: \['bypass_mode'"
    ):
        get_policy_loss_fn("nope")

    @register_policy_loss("test_only_zero")
    def zero_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None
    ):
        return log_prob.sum() * 0, {}

    try:
        assert get_policy_loss_fn("test_only_zero") is zero_loss
    finally:
        del POLICY_LOSS_REGISTRY["test_only_zero"]


@pytest.mark.parametrize("name", ["vanilla", "gspo", "sapo", "cispo", "dppo_tv", "geo_mean"])
def test_loss_metrics_stay_on_the_losss_device(name):
    """Under ``metrics_on_device`` every metric is a tensor on the loss's device (here "meta"): the
    actor sums them per micro-batch, and a CPU zero (gspo, sapo, cispo had one) is a host-to-device
    copy every micro-batch on a GPU."""
    from verl_megatron.algos.policy_losses import metrics_on_device

    cfg = SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
        policy_loss=SimpleNamespace(dro_beta=0.1), global_batch_info={},
    )  # fmt: skip
    zeros = torch.zeros(2, 3, device="meta")
    with metrics_on_device():
        _, metrics = get_policy_loss_fn(name)(zeros, zeros, zeros, zeros + 1, "token-mean", cfg)
    assert {k: str(v.device) for k, v in metrics.items()} == {
        f"actor/{k}": "meta" for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
    }
