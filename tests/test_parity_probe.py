"""The parity probe of bypass mode (trainer/parity_probe.py): a bypass + bitwise-parity run logs
``rollout/parity_probe/max_diff`` = 0.0 at the probe steps only, and a one-ulp mismatch between the
rollout's and the actor's log-probs stops the run with ParityProbeError naming the step."""

from __future__ import annotations

import pytest
import torch

BYPASS = "algorithm.rollout_correction.bypass_mode=true"


def probe_job(out_dir: str, overrides: list[str], perturb: bool) -> dict:
    """tests.test_rollout_parity's short parity run; with ``perturb`` the actor's recomputed
    log-probs move by one ulp at one token (what a kernel that breaks parity would do)."""
    from tests.test_rollout_parity import trainer_job
    from verl_megatron.trainer.parity_probe import ParityProbeError
    from verl_megatron.workers.actor import MegatronActor

    original = MegatronActor.compute_log_prob

    def perturbed(self, data, *args, **kwargs):
        log_probs, entropy = original(self, data, *args, **kwargs)
        log_probs = log_probs.clone()
        log_probs[0, 0] = torch.nextafter(log_probs[0, 0], torch.tensor(-1e9, dtype=log_probs.dtype))
        return log_probs, entropy

    if perturb:
        MegatronActor.compute_log_prob = perturbed
    try:
        return trainer_job(out_dir, [BYPASS, *overrides])
    except ParityProbeError as err:
        return {"error": str(err)}
    finally:
        MegatronActor.compute_log_prob = original


def _probe_run(pool, tmp_path, interval: int, perturb: bool) -> dict:
    overrides = [f"rollout.parity_probe_interval={interval}"]
    return pool.run(
        f"{__name__}:probe_job", out_dir=str(tmp_path / "run"), overrides=overrides, perturb=perturb
    )[0]


def test_probe_logs_zero_at_its_steps_only(pool1, tmp_path):
    run = _probe_run(pool1, tmp_path, interval=2, perturb=False)
    rows = run["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    assert "rollout/parity_probe/max_diff" not in rows[0] and "timing_s/parity_probe" not in rows[0]
    assert rows[1]["rollout/parity_probe/max_diff"] == 0.0 and rows[1]["timing_s/parity_probe"] > 0
    assert run["log_prob_calls"] == 1  # the probe's one recomputation; bypass itself skips the pass


def test_one_ulp_mismatch_stops_the_run_naming_the_step(pool1, tmp_path):
    run = _probe_run(pool1, tmp_path, interval=1, perturb=True)
    message = run["error"]
    assert message.startswith("step 1: bitwise parity broken") and "\n" not in message
    # One ulp of a float32 log-prob of a few nats: between 2**-24 and 2**-20.
    worst = float(message.split("by up to ")[1].split(" ")[0])
    assert 2**-24 <= worst <= 2**-20, message


def test_probe_helpers():
    from verl_megatron.trainer.parity_probe import max_log_prob_diff, probe_rows

    assert probe_rows(16, dp=2, micro_batch_size=4) == 8
    assert probe_rows(6, dp=2, micro_batch_size=4) == 6
    assert probe_rows(16, dp=3, micro_batch_size=None) == 3  # token-budget micro-batches: a row a rank
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    recomputed = torch.tensor([[-1.0, -2.5, -3.0], [-0.5, -0.25, -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the -7.0 is padding: not counted
    assert max_log_prob_diff(rollout, recomputed, mask) == 0.5
    assert max_log_prob_diff(rollout, recomputed, torch.zeros_like(mask)) == 0.0


def test_interval_is_checked():
    from verl_megatron.errors import UserInputError
    from verl_megatron.rollout.config import RolloutConfig

    assert RolloutConfig().parity_probe_interval == 10
    with pytest.raises(UserInputError, match=r"rollout\.parity_probe_interval must be an integer >= 0"):
        RolloutConfig(parity_probe_interval=-1)
