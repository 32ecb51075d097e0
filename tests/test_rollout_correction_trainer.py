"""algorithm.rollout_correction in the trainer (verl 0.9.1's decoupled mode): named start-up
errors, the step's IS weights / rejection mask / rollout_corr metrics on hand-computed
cases, and a real trainer step and actor update that use them."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from verl_megatron.errors import ConfigError
from verl_megatron.protocol import DataProto
from verl_megatron.trainer.config import load_config
from verl_megatron.trainer.ppo.rollout_correction import apply_rollout_correction
from verl_megatron.trainer.ppo.rollout_correction_config import RolloutCorrectionConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
RC = "algorithm.rollout_correction"
LN = math.log


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"{RC}.rollout_is=tokens"], f"{RC}.rollout_is must be null, 'token' or 'sequence'"),
        ([f"{RC}.rollout_is_threshold=-2"], f"{RC}.rollout_is_threshold: "),
        ([f"{RC}.rollout_is_threshold=2.0_1.0"], f"{RC}.rollout_is_threshold: "),
        ([f"{RC}.rollout_rs=token_k9", f"{RC}.rollout_rs_threshold=2"], f"{RC}.rollout_rs: Invalid"),
        ([f"{RC}.rollout_rs=seq_sum_k1"], f"needs {RC}.rollout_rs_threshold"),
        ([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=0.5_2.0"], f"{RC}.rollout_rs_threshold:"),
        ([f"{RC}.loss_type=ppo"], f"{RC}.loss_type must be one of"),
    ],
)
def test_bad_settings_are_named_at_load(overrides, message) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, overrides)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_external_engine_without_log_probs_is_refused_at_start_up() -> None:
    from verl_megatron.trainer.config import _check_algorithm

    config = load_config(QUICKSTART, ["rollout.name=vllm", f"{RC}.rollout_is=token"])
    with pytest.raises(ValueError, match=r"set rollout\.calculate_log_probs=true \(rollout\.name='vllm'"):
        _check_algorithm(config)
    config = load_config(QUICKSTART, ["rollout.name=vllm", "rollout.calculate_log_probs=true"])
    _check_algorithm(config)  # off: nothing needed


def _batch(ratios: list[list[float]], mask: list[list[float]]) -> DataProto:
    """old - rollout log-probs = log(ratio) (rollout log-probs fixed at -1)."""
    ratio, mask_t = torch.tensor(ratios, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)
    rollout = torch.full_like(ratio, -1.0)
    return DataProto.from_dict(
        {"old_log_probs": rollout + ratio.log(), "rollout_log_probs": rollout, "response_mask": mask_t}
    )


# Row 0: ratios 0.5, 3 and a padded 5; row 1: ratios 2, 1.5 (product 3).
RATIOS, MASK = [[0.5, 3.0, 5.0], [2.0, 1.5, 1.0]], [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]


def test_token_tis_with_token_rejection_hand_computed() -> None:
    batch = _batch(RATIOS, MASK)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.6_2.5")
    m = apply_rollout_correction(batch, cfg)
    # TIS: w = min(ratio, 2), 0 on padding
    expected_w = torch.tensor([[0.5, 2.0, 0.0], [2.0, 1.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected_w)
    # verl's k1 statistic is -log r, kept inside [log 0.6, log 2.5]: ratios in [1/2.5, 1/0.6]
    # = [0.4, 1.67] stay, so 3 and 2 go
    torch.testing.assert_close(
        batch.batch["response_mask"], torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    )
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(6.0 / 4)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.25)  # raw 3 > 2
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # verl: kl = E[log pi_rollout - log pi_train] over the original mask
    assert m["rollout_corr/kl"] == pytest.approx(-(LN(0.5) + LN(3) + LN(2) + LN(1.5)) / 4)
    assert m["rollout_corr/chi2_token"] == pytest.approx((0.25 + 9 + 4 + 2.25) / 4 - 1)


def test_sequence_mis_and_icepop_hand_computed() -> None:
    # sequence level, IcePop-style band [0.5, 2]: row products 1.5 (kept) and 3 (zeroed)
    batch = _batch(RATIOS, MASK)
    m = apply_rollout_correction(
        batch, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    )
    expected = torch.tensor([[1.5, 1.5, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected)
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(0.5)
    torch.testing.assert_close(batch.batch["response_mask"], torch.tensor(MASK, dtype=torch.float64))
    # sequence TIS at 2 truncates row 1's product 3; sequence rejection seq_sum_k1 keeps
    # rows whose -log(product) lies in [log(1/2.5), log 2.5]: row 1 (product 3) goes
    batch = _batch(RATIOS, MASK)
    cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold=2.5)
    m = apply_rollout_correction(batch, cfg)
    torch.testing.assert_close(
        batch.batch["rollout_is_weights"],
        torch.tensor([[1.5, 1.5, 0.0], [2.0, 2.0, 0.0]], dtype=torch.float64),
    )
    torch.testing.assert_close(
        batch.batch["response_mask"], torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    )
    assert m["rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction"] == pytest.approx(0.5)


def test_off_or_bypass_leaves_the_batch_alone() -> None:
    for cfg in (RolloutCorrectionConfig(), RolloutCorrectionConfig(bypass_mode=True, rollout_is="token")):
        batch = _batch(RATIOS, MASK)
        assert apply_rollout_correction(batch, cfg) == {}
        assert "rollout_is_weights" not in batch.batch.keys()  # noqa: SIM118


def trainer_and_actor_job(out_dir: str) -> dict:
    """One quickstart step with token TIS + token rejection on, then one actor update of
    the same kind with IS weights 2 and without: the pg_loss of the first mini-batch
    (ratio exactly 1) doubles when the weights reach the loss."""
    from tests.test_actor_update import TEMPERATURE, actor_config, build_hf_model, build_model, make_batch
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.train import run
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    run(
        QUICKSTART,
        [
            f"trainer.default_local_dir={out_dir}/run", "trainer.total_training_steps=1",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.export_hf=false",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=4",
            "quickstart.hidden_size=32", "quickstart.intermediate_size=64",
            f"{RC}.rollout_is=token", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_2.0",
        ],
    )  # fmt: skip
    with open(f"{out_dir}/run/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    path = f"{out_dir}/model"
    build_hf_model(path)
    runtime = init_runtime(ParallelLayout(), seed=5)
    losses = []
    for weight in (None, 2.0):
        cfg = actor_config("padded")
        chunks = build_model(runtime, path)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        actor = MegatronActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
        data.batch["old_log_probs"], _ = actor.compute_log_prob(data)
        data.batch["ref_log_prob"] = data.batch["old_log_probs"]
        if weight is not None:
            data.batch["rollout_is_weights"] = torch.full_like(data.batch["old_log_probs"], weight)
        losses.append(actor.update_policy(data)["actor/pg_loss"][0])
    return {"rows": rows, "losses": losses}


@pytest.fixture(scope="module")
def trained(pool1, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("rollout_corr"))
    return pool1.run(f"{__name__}:trainer_and_actor_job", out_dir=out)[0]


def test_trainer_step_logs_rollout_corr_metrics(trained) -> None:
    (row,) = [r for r in trained["rows"] if r.get("step") == 1]
    for key in (
        "rollout_is_mean",
        "rollout_is_eff_sample_size",
        "rollout_rs_masked_fraction",
        "kl",
        "chi2_token",
    ):
        assert f"rollout_corr/{key}" in row, sorted(k for k in row if k.startswith("rollout_corr"))
    # colocated native rollout: the rollout's policy is the trained one, weights ~1, nothing rejected
    assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert abs(row["rollout_corr/kl"]) < 1e-5


def test_is_weights_reach_the_actor_loss(trained) -> None:
    plain, weighted = trained["losses"]
    assert plain != 0.0
    assert weighted == pytest.approx(2.0 * plain, rel=1e-5), (plain, weighted)
