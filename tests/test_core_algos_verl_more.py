"""verl 0.9.1 pieces of core_algos: the newer losses and estimators, PF-PPO, registries
rebound through core_algos, verl's error types; hand-computed numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_megatron.algos.pf_ppo import pf_ppo_weights
from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo import core_algos

LN = math.log


@dataclass
class PolicyLossCfg:
    loss_mode: str = "vanilla"
    dro_beta: float | None = None
    rollout_correction: dict | None = None


@dataclass
class ActorCfg:
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    policy_loss: PolicyLossCfg = field(default_factory=PolicyLossCfg)
    global_batch_info: dict = field(default_factory=dict)


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_carries_the_return_across_a_masked_observation_span() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    _, returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=SimpleNamespace(gamma=0.5)
    )
    # the span is skipped, not discounted and not a restart (old code: [0, 0, 0, 1, 2])
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0, 0.0, 0.0, 2.0]]))


def test_reinforce_pp_without_gamma_is_a_value_and_assertion_error() -> None:
    for error in (ValueError, AssertionError):  # verl asserts config is not None
        with pytest.raises(error, match=r"needs config\.gamma"):
            core_algos.compute_reinforce_plus_plus_outcome_advantage(torch.zeros(1, 2), torch.ones(1, 2))


# ---------------------------------------------------------------- registries


def test_registries_rebound_on_core_algos_are_the_ones_used(monkeypatch) -> None:
    def fake_loss(*args, **kwargs):
        return torch.zeros(()), {}

    monkeypatch.setattr(core_algos, "POLICY_LOSS_REGISTRY", {"only": fake_loss})
    monkeypatch.setattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {"gae": abs})
    assert core_algos.get_policy_loss_fn("only") is fake_loss
    with pytest.raises(ValueError, match=r"Supported modes are: \['only'\]"):
        core_algos.get_policy_loss_fn("vanilla")
    core_algos.register_adv_est("new_est")(round)
    assert {"gae": abs, "new_est": round} == core_algos.ADV_ESTIMATOR_REGISTRY
    assert core_algos.get_adv_estimator_fn("new_est") is round
    with pytest.raises(ValueError, match="Unknown advantage estimator simply: grpo"):
        core_algos.get_adv_estimator_fn("grpo")


# ---------------------------------------------------------------- estimators

SCORES = torch.tensor([1.0, 2.0, 4.0, 5.0])
GROUPS = np.array(["a", "a", "a", "solo"], dtype=object)


def test_rloo_vectorized_matches_rloo_except_singletons() -> None:
    rewards, mask = torch.zeros(4, 2), torch.ones(4, 2)
    rewards[:, 1] = SCORES
    adv, ret = core_algos.compute_rloo_vectorized_outcome_advantage(rewards, mask, GROUPS)
    # group a: (3 s - 7) / 2 = -2, -0.5, 2.5; a singleton gets 0 here (rloo keeps its score)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-2.0, -0.5, 2.5, 0.0]))
    torch.testing.assert_close(ret, adv)
    loop_adv, _ = core_algos.compute_rloo_outcome_advantage(rewards, mask, GROUPS)
    torch.testing.assert_close(loop_adv[:, 0], torch.tensor([-2.0, -0.5, 2.5, 5.0]))


def test_grpo_vectorized_registered_with_grpo_numbers() -> None:
    rewards = torch.zeros(4, 1)
    rewards[:, 0] = SCORES
    adv, _ = core_algos.get_adv_estimator_fn("grpo_vectorized")(rewards, torch.ones(4, 1), GROUPS)
    std = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    expected = [(s - 7 / 3) / (std + 1e-6) for s in (1.0, 2.0, 4.0)] + [5.0 / (1 + 1e-6)]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected))


def test_gdpo_normalises_each_component_then_weights_and_whitens() -> None:
    # one group of two one-token responses; component fmt [1, 0] -> GRPO +-1 (std 0.707),
    # component acc [0, 0] -> 0; weights 2, 1 -> [2, -2]; whitened: 2 / sqrt(8) each way
    batch = {"prompts": torch.zeros(2, 2), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])}
    non_tensor = {"fmt": np.array([1.0, 0.0]), "acc": np.array([0.0, 0.0])}
    config = {"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [2.0, 1.0]}
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    adv, _ = core_algos.compute_gdpo_outcome_advantage(
        torch.zeros(2, 2), mask, np.array(["g", "g"]), config=config, non_tensor_batch=non_tensor, batch=batch
    )
    root_half = math.sqrt(0.5)
    value = 2 * root_half / (root_half + 1e-6) / math.sqrt(8 * (root_half / (root_half + 1e-6)) ** 2 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[value, 0.0], [-value, 0.0]]))
    with pytest.raises(AssertionError, match="gdpo_reward_keys"):
        core_algos.compute_gdpo_outcome_advantage(
            torch.zeros(2, 2), mask, np.array(["g", "g"]), config={}, non_tensor_batch=non_tensor, batch=batch
        )


# pi = 0.5 everywhere, sum pi^2 = 0.5 -> w = 1 - 2 * 0.5 + 0.5 = 0.5 per token
HALF = torch.full((2, 3), LN(0.5))
PI2 = torch.full((2, 3), 0.5)


def test_optimal_token_baseline_and_its_zero_tail() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv, ret = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, np.array([0, 0]), HALF, PI2)
    # G: row0 [1, 1, 0], row1 [0, 0, 0]; W: row0 [0.5, 1, 1], row1 [0.5, 0.5, 0.5]
    # B_0 = (1 * 0.5) / (0.5 + 0.5) = 0.5; at t = 1 only row 0 remains and its tail baseline is 0
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0, 0.0], [-0.5, 0.0, 0.0]]))
    no_tail, _ = core_algos.compute_optimal_token_baseline_advantage(
        rewards, mask, np.array([0, 0]), HALF, PI2, handle_zero_tail=False
    )
    torch.testing.assert_close(no_tail[0, 1], torch.tensor(1.0 - 1.0 / (1.0 + 1e-8)))


def test_tir_optimal_token_baseline_aligns_steps_across_observation_spans() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])  # row 0 has an observation at t = 1
    adv, ret = core_algos.compute_multi_turn_optimal_token_baseline_advantage(
        rewards, mask, np.array([0, 0]), HALF, PI2
    )
    # packed steps: row0 G [1, 1] W [0.5, 1]; row1 G [0, 0] W [0.5, 1] -> B = [0.5, 0.5]
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- policy losses


def test_dppo_tv_masks_tokens_outside_the_probability_trust_region() -> None:
    old = torch.full((1, 2), LN(0.5), dtype=torch.float64)
    log_prob = torch.tensor([[LN(0.8), LN(0.6)]], dtype=torch.float64, requires_grad=True)
    adv = torch.ones(1, 2, dtype=torch.float64)
    loss, metrics = core_algos.get_policy_loss_fn("dppo_tv")(
        old, log_prob, adv, torch.ones(1, 2), "token-mean", ActorCfg()
    )
    # p - p_old = 0.3 > 0.2: out (no gradient); 0.1: in, weight sg(min(r, 3)) = 1.2
    assert loss.item() == pytest.approx(-1.2 * LN(0.6) / 2)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.6]], dtype=torch.float64))


def test_dppo_kl_uses_the_binary_kl_and_lets_moves_toward_old_through() -> None:
    old = torch.full((1, 3), LN(0.5), dtype=torch.float64)
    log_prob = torch.tensor([[LN(0.8), LN(0.6), LN(0.9)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    loss, metrics = core_algos.get_policy_loss_fn("dppo_kl")(
        old, log_prob, adv, torch.ones(1, 3), "token-sum", ActorCfg()
    )
    # binary KL(0.5 -> 0.8) = 0.2231 > 0.2: out; (0.5 -> 0.6) = 0.0204: in;
    # A < 0 with p > p_old: always in (r = 1.8)
    assert loss.item() == pytest.approx(-1.2 * LN(0.6) + 1.8 * LN(0.9))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_dro_quadratic_penalty_and_required_beta() -> None:
    old = torch.tensor([[-1.0, -0.7, -0.2]])
    log_prob = torch.tensor([[-0.8, -0.9, -0.1]])
    adv = torch.tensor([[2.0, -1.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    cfg = ActorCfg(policy_loss=PolicyLossCfg(loss_mode="dro", dro_beta=0.05))
    loss, metrics = core_algos.compute_policy_loss_dro(old, log_prob, adv, mask, "token-mean", cfg)
    expected = (-(-0.8 * 2.0 - 0.025 * 0.2**2) - (-0.9 * -1.5 - 0.025 * 0.2**2)) / 2
    assert loss.item() == pytest.approx(expected)
    assert metrics == {"actor/ppo_kl": pytest.approx(0.0)}
    with pytest.raises(ValueError, match="dro_beta must be a positive value"):
        core_algos.compute_policy_loss_dro(old, log_prob, adv, mask, "token-mean", ActorCfg())


def test_reinforce_loss_with_is_weights() -> None:
    rollout = torch.tensor([[-1.0, -2.0]])
    log_prob = torch.tensor([[-0.5, -1.0]])
    adv = torch.tensor([[1.0, -2.0]])
    weights = torch.tensor([[2.0, 0.5]])
    loss, metrics = core_algos.compute_policy_loss_reinforce(
        rollout, log_prob, adv, torch.ones(1, 2), "seq-mean-token-sum", ActorCfg(), weights
    )
    assert loss.item() == pytest.approx(-(1.0 * -0.5 * 2.0) - (-2.0 * -1.0 * 0.5))
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.75)


def test_bypass_mode_dispatches_on_loss_type() -> None:
    rollout = torch.full((1, 2), LN(0.5), dtype=torch.float64)
    log_prob = torch.tensor([[LN(0.6), LN(0.5)]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    corr = {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0}
    cfg = ActorCfg(policy_loss=PolicyLossCfg(loss_mode="bypass_mode", rollout_correction=corr))
    loss, metrics = core_algos.get_policy_loss_fn("bypass_mode")(
        rollout, log_prob, adv, mask, "token-mean", cfg
    )
    # IS weights pi / pi_rollout = 1.2, 1
    assert loss.item() == pytest.approx(-(1.2 * LN(0.6) + LN(0.5)) / 2)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.1)
    cfg.policy_loss.rollout_correction = {"loss_type": "ppo_clip"}
    loss, _ = core_algos.compute_policy_loss_bypass_mode(rollout, log_prob, adv, mask, "token-mean", cfg)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)  # vanilla PPO, ratio 1.2 inside the clip
    cfg.policy_loss.rollout_correction = None
    with pytest.raises(ValueError, match="rollout_correction is not set"):
        core_algos.compute_policy_loss_bypass_mode(rollout, log_prob, adv, mask, "token-mean", cfg)


def test_token_sum_reaches_value_loss() -> None:
    vpreds = torch.tensor([[1.0, 2.0, 5.0]])
    returns = torch.tensor([[0.0, 0.0, 0.0]])
    loss, _ = core_algos.compute_value_loss(
        vpreds, returns, vpreds, torch.tensor([[1, 1, 0]]), 0.5, "token-sum"
    )
    assert loss.item() == pytest.approx(0.5 * (1.0 + 4.0))


# ---------------------------------------------------------------- PF-PPO


def test_pf_ppo_weights_and_resampling() -> None:
    scores = torch.tensor([-2.0, 0.5, 3.0, 0.0])
    torch.testing.assert_close(pf_ppo_weights(scores, "pow", 2.0), torch.tensor([4.0, 0.25, 9.0, 0.0]))
    torch.testing.assert_close(pf_ppo_weights(scores, "max_min", 2.0), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    torch.testing.assert_close(pf_ppo_weights(scores, "max_random", 2.0), torch.tensor([0.1, 0.1, 0.4, 0.1]))
    data = DataProto.from_dict(
        tensors={"token_level_scores": scores.unsqueeze(-1), "row": torch.arange(4)},
        non_tensors={"uid": np.array(["a", "b", "c", "d"], dtype=object)},
        meta_info={"per_row": [10, 11, 12, 13], "other": 7},
    )
    torch.manual_seed(0)
    out = core_algos.compute_pf_ppo_reweight_data(data, "max_min")
    rows = out.batch["row"].tolist()
    assert len(rows) == 4 and set(rows) <= {0, 2}  # the other rows have weight 1e-8
    assert list(out.non_tensor_batch["uid"]) == ["abcd"[r] for r in rows]
    assert out.meta_info == {"per_row": [10 + r for r in rows], "other": 7}
    assert data.batch["row"].tolist() == [0, 1, 2, 3]  # the input is left alone
    with pytest.raises(ValueError, match="Unsupported reweight_method: 'top'"):
        core_algos.compute_pf_ppo_reweight_data(data, "top")


# ---------------------------------------------------------------- trainer config


def _config_error(overrides: list[str]) -> str:
    import os

    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import load_config, validate_config

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart.yaml"
    )
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(path, overrides), 1)
    return str(err.value)


def test_trainer_config_refuses_what_the_trainer_cannot_feed() -> None:
    assert "needs the actor's sum of squared token probabilities" in _config_error(
        ["algorithm.adv_estimator=optimal_token_baseline"]
    )
    assert "bypass_mode trains on the rollout's log-probs" in _config_error(
        ["actor.policy_loss.loss_mode=bypass_mode"]
    )
    assert "gdpo needs algorithm.gdpo_reward_keys" in _config_error(["algorithm.adv_estimator=gdpo"])
    assert "rollout.n must be >= 2, got 1" in _config_error(
        ["algorithm.adv_estimator=rloo_vectorized", "rollout.n=1"]
    )
