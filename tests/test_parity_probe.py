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


class _FakeActor:
    """compute_log_prob returns the rollout's log-probs, plus 0.25 on rows marked ``off`` (as a row
    generated with older weights would differ); records the rows it was asked for."""

    def __init__(self, dp: int = 1):
        from types import SimpleNamespace

        self.config = SimpleNamespace(
            ppo_infer_micro_batch_size_per_gpu=2, ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False
        )
        self.runtime = SimpleNamespace(layout=SimpleNamespace(dp=dp))
        self.asked: list[list[int]] = []

    def compute_log_prob(self, data):
        self.asked.append(data.batch["row"].tolist())
        return data.batch["rollout_log_probs"] + 0.25 * data.batch["off"][:, None], None


def _async_batch(versions: list[list[int]]):
    from verl_megatron.protocol import DataProto

    v = torch.tensor(versions)
    return DataProto.from_dict({
        "rollout_versions": v, "rollout_log_probs": -torch.rand(v.shape, dtype=torch.float32),
        "response_mask": (v >= 0).long(), "row": torch.arange(len(v)), "off": ((v >= 0) & (v != 4)).any(-1),
    })  # fmt: skip


def test_async_rows_of_older_weights_are_not_probed():
    """Step 5 trains weights of version 4: rows holding a token of version 3 are off-policy by design."""
    from types import SimpleNamespace

    from verl_megatron.trainer.parity_probe import METRIC, parity_probe

    rollout, actor = SimpleNamespace(parity_probe_interval=5, bitwise_parity=True), _FakeActor(dp=1)
    batch = _async_batch([[3, 3, -1], [4, 4, 4], [3, 4, -1], [4, -1, -1], [4, 4, -1]])
    timing: dict[str, float] = {}
    assert parity_probe(actor, batch, 5, rollout, timing) == {METRIC: 0.0}
    assert actor.asked == [[1, 3]]  # the first micro-batch of current rows (2 of them at dp=1)
    assert parity_probe(actor, batch, 4, rollout, timing) == {}  # not a probe step
    assert parity_probe(actor, _async_batch([[3, 3], [3, -1]]), 5, rollout, timing) == {}  # none current
    assert len(actor.asked) == 1


def test_probe_at_dp2_is_collective_and_exact(pool2, tmp_path):
    """Both ranks hold the gathered batch and probe the same rows (one micro-batch each)."""
    runs = pool2.run(
        f"{__name__}:probe_job", out_dir=str(tmp_path / "run"), overrides=["rollout.parity_probe_interval=1"],
        perturb=False,
    )  # fmt: skip
    assert [r["rollout/parity_probe/max_diff"] for r in runs[0]["rows"]] == [0.0, 0.0]
    assert runs[0]["log_prob_calls"] == 2 and runs[1] == {}  # rank 1 reports nothing
