"""One step of staleness (async training, ``max_staleness=1``): the decoupled objective with
rollout correction's token IS weights gives, in expectation over the stale (behaviour) policy's
samples, the on-policy policy gradient of the proximal policy. Checked exactly in float64 on a
categorical policy by enumerating every token with its behaviour probability, through the
trainer's ``apply_rollout_correction`` and the actor's ``vanilla`` policy loss."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl_megatron.algos import core_algos
from verl_megatron.protocol import DataProto
from verl_megatron.trainer.ppo.rollout_correction import apply_rollout_correction
from verl_megatron.trainer.ppo.rollout_correction_config import RolloutCorrectionConfig

VOCAB = 6
LOSS_CONFIG = SimpleNamespace(
    clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, policy_loss=SimpleNamespace()
)


def _policies() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Proximal logits (the trainer's weights now), behaviour logits (one step older) and advantages."""
    gen = torch.Generator().manual_seed(0)
    proximal = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    behaviour = proximal + 0.3 * torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    advantages = torch.randn(VOCAB, generator=gen, dtype=torch.float64)
    return proximal, behaviour, advantages


def _decoupled_gradient(threshold: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d logits at the proximal policy (the first mini-batch: ratio 1), one row per token
    y with its advantage scaled by VOCAB * behaviour(y), so the token-mean loss is the expectation
    over behaviour samples; and the IS weights used (None: no correction)."""
    proximal, behaviour, advantages = _policies()
    logits = proximal.clone().requires_grad_(True)
    tokens = torch.arange(VOCAB)
    log_prob = torch.log_softmax(logits, -1)[tokens].unsqueeze(-1)  # [V, 1]: row y samples token y
    old = log_prob.detach()
    behaviour_lp = torch.log_softmax(behaviour, -1)[tokens].unsqueeze(-1)
    mask = torch.ones(VOCAB, 1, dtype=torch.float64)
    weights = None
    if threshold is not None:
        batch = DataProto.from_dict(
            {"old_log_probs": old, "rollout_log_probs": behaviour_lp, "response_mask": mask}
        )
        config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=threshold)
        apply_rollout_correction(batch, config)
        weights = batch.batch["rollout_is_weights"]
    scaled = (advantages * VOCAB * behaviour_lp.squeeze(-1).exp()).unsqueeze(-1)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old, log_prob, scaled, mask, "token-mean", LOSS_CONFIG, weights
    )
    (grad,) = torch.autograd.grad(loss, logits)
    return grad, weights


def _expected_gradient(weight_of: torch.Tensor) -> torch.Tensor:
    """-sum_y behaviour(y) w(y) A(y) d log proximal(y) / d logits, by hand: d log p_y / dz = e_y - p."""
    proximal, behaviour, advantages = _policies()
    p, b = torch.softmax(proximal, -1), torch.softmax(behaviour, -1)
    jac = torch.eye(VOCAB, dtype=torch.float64) - p  # row y: d log p_y / dz
    return -((b * weight_of * advantages).unsqueeze(-1) * jac).sum(0)


def test_token_is_makes_the_stale_gradient_the_on_policy_one():
    proximal, behaviour, _ = _policies()
    ratio = torch.softmax(proximal, -1) / torch.softmax(behaviour, -1)
    assert float(ratio.max()) < 10.0  # no truncation at 10: the identity is exact
    grad, weights = _decoupled_gradient(threshold=10.0)
    torch.testing.assert_close(weights.squeeze(-1), ratio, rtol=1e-12, atol=0.0)
    on_policy = _expected_gradient(ratio)  # behaviour * proximal/behaviour = proximal
    diff = (grad - on_policy).abs()
    assert float(diff.max()) < 1e-12, (
        f"decoupled vs on-policy gradient: max diff {float(diff.max()):.3e} at {int(diff.argmax())}"
    )
    # Without the weights the stale samples give another gradient (the check can fail).
    stale, _ = _decoupled_gradient(threshold=None)
    assert float((stale - on_policy).abs().max()) > 1e-3


def test_truncated_weights_enter_as_min_of_ratio_and_threshold():
    proximal, behaviour, _ = _policies()
    ratio = torch.softmax(proximal, -1) / torch.softmax(behaviour, -1)
    threshold = float(ratio.sort().values[-2])  # truncates the largest weight only
    grad, _ = _decoupled_gradient(threshold=threshold)
    assert float((grad - _expected_gradient(ratio)).abs().max()) > 1e-4  # the truncation shows
    diff = (grad - _expected_gradient(ratio.clamp(max=threshold))).abs()
    assert float(diff.max()) < 1e-12, (
        f"truncated IS gradient: max diff {float(diff.max()):.3e} at {int(diff.argmax())}"
    )
