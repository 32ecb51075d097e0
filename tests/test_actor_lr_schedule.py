"""Learning-rate schedules from OptimConfig, by hand, and config validation."""

from __future__ import annotations

import math

import pytest

from verl_megatron.errors import WorkerConfigError
from verl_megatron.workers.config import ActorConfig, CriticConfig, OptimConfig, PolicyLossConfig, RefConfig
from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings, warmup_steps


class _Groups:
    """Stands in for a megatron optimizer: the scheduler only writes param_groups."""

    def __init__(self) -> None:
        self.param_groups = [{"params": []}, {"params": [], "wd_mult": 0.0}]


def _lrs(optim: OptimConfig, steps: int) -> list[float]:
    opt = _Groups()
    scheduler = build_lr_scheduler(opt, optim)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        scheduler.step(1)
    return out


def test_constant_with_warmup_steps():
    lrs = _lrs(OptimConfig(lr=1.0, lr_warmup_steps=4), 7)
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_warmup_from_ratio_and_cosine_decay_to_min_lr():
    optim = OptimConfig(
        lr=1.0, min_lr=0.1, lr_warmup_steps_ratio=0.2, total_training_steps=10, lr_decay_style="cosine"
    )
    assert warmup_steps(optim) == 2
    lrs = _lrs(optim, 11)
    assert lrs[:3] == [0.0, 0.5, 1.0]
    # Step 6: (6 - 2) / (10 - 2) = half-way through the cosine -> min + 0.5 * (max - min).
    assert math.isclose(lrs[6], 0.1 + 0.5 * 0.9, rel_tol=1e-12)
    assert math.isclose(lrs[10], 0.1, rel_tol=1e-12)


def test_no_warmup_starts_at_lr_and_weight_decay_respects_groups():
    opt = _Groups()
    build_lr_scheduler(opt, OptimConfig(lr=3e-6, weight_decay=0.1))
    assert opt.param_groups[0]["lr"] == 3e-6
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0


def test_schedules_that_need_the_run_length_say_so():
    with pytest.raises(WorkerConfigError, match="total_training_steps"):
        warmup_steps(OptimConfig(lr_warmup_steps_ratio=0.1))
    with pytest.raises(WorkerConfigError, match="lr_decay_steps"):
        build_lr_scheduler(_Groups(), OptimConfig(lr_decay_style="linear"))


def test_optim_settings_carry_the_config():
    settings = optim_settings(OptimConfig(lr=2e-5, betas=(0.8, 0.95), clip_grad=0.5, weight_decay=0.0))
    assert (settings.lr, settings.betas, settings.clip_grad, settings.weight_decay) == (
        2e-5,
        (0.8, 0.95),
        0.5,
        0.0,
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ActorConfig().validate(), "ppo_micro_batch_size_per_gpu must be set"),
        (lambda: ActorConfig(ppo_micro_batch_size_per_gpu=2, loss_agg_mode="mean"), "loss_agg_mode"),
        (lambda: ActorConfig(ppo_micro_batch_size_per_gpu=2, kl_loss_type="k9"), "kl_loss_type 'k9'"),
        (lambda: ActorConfig(ppo_micro_batch_size=8, ppo_micro_batch_size_per_gpu=2), "deprecated"),
        (lambda: PolicyLossConfig(loss_mode="nope"), "loss_mode 'nope' is not registered"),
        (
            lambda: CriticConfig(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=0),
            "ppo_max_token_len_per_gpu",
        ),
        (lambda: RefConfig().validate(), "log_prob_micro_batch_size_per_gpu"),
        (lambda: OptimConfig(lr_decay_style="exp"), "lr_decay_style"),
        (lambda: OptimConfig(lr=1e-6, min_lr=1e-5), "min_lr"),
    ],
)
def test_bad_settings_raise_naming_the_field(make, message):
    with pytest.raises(WorkerConfigError, match=message):
        make()


def test_defaults_follow_verl():
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=1)
    assert (actor.ppo_mini_batch_size, actor.clip_ratio, actor.kl_loss_type, actor.loss_agg_mode) == (
        256,
        0.2,
        "low_var_kl",
        "token-mean",
    )
    assert actor.infer_micro_batch_size == 1 and actor.shuffle is False and actor.optim.lr == 1e-6
    critic = CriticConfig(ppo_micro_batch_size_per_gpu=1)
    assert (critic.cliprange_value, critic.shuffle, critic.optim.lr) == (0.5, True, 1e-5)
