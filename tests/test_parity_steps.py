"""Bitwise parity holds at every step of a run, not only until the first update (issue 32).

``rollout.bitwise_parity`` makes the native engine's log-probs the actor's ``old_log_probs`` bit
for bit. A defect that only shows after the weights (or any state shared by training and
rollout) change cannot be seen in one step, so every run here trains 4 steps with two optimizer
updates a step (steps 2-4 roll out with weights moved by 2, 4 and 6 updates) and asserts ``rollout/logprob_diff/max == 0.0`` (and no token differing) at each:
1 process in float32 with padded rows and with packed rows + dynamic micro-batches, bf16, LoRA,
tp=2, pp=2, dp=2, MoE with routing replay at ep=2 and LoRA at tp=2 (two processes, gloo), and across a resume
(2 steps, stop, resume to 4: the same numbers as the uninterrupted run).

With parity, ``algorithm.rollout_correction.bypass_mode=true`` must learn like the plain
quickstart: tests/test_quickstart.py compares their validation curves over 60 steps, sharing the
quickstart run its main test makes.
"""

from __future__ import annotations

import os

import pytest

from tests.test_rollout_parity import trainer_job

STEPS = 4
ALL_STEPS = [f"trainer.total_training_steps={STEPS}"]
PADDED = ["actor.use_remove_padding=false", "actor.use_dynamic_bsz=false"]


def layouts_job(out_root: str, runs: dict[str, list[str]]) -> dict:
    """Several short quickstart runs in one job (one pool start for all); rank 0's rows per run."""
    return {
        name: trainer_job(os.path.join(out_root, name), [*ALL_STEPS, *overrides]).get("rows")
        for name, overrides in runs.items()
    }


def resume_job(out_dir: str) -> dict:
    """2 steps with a checkpoint at step 2, then the same run resumed up to step STEPS."""
    first = trainer_job(out_dir, ["trainer.total_training_steps=2", "trainer.save_freq=2"])
    second = trainer_job(out_dir, [*ALL_STEPS, "trainer.save_freq=2", "trainer.resume_mode=auto"])
    return {"first": first.get("rows"), "resumed": second.get("rows")}


def _assert_zero_every_step(rows: list[dict], steps: list[int], what: str) -> None:
    assert [r["step"] for r in rows] == steps, what
    diffs = [r["rollout/logprob_diff/max"] for r in rows]
    assert diffs == [0.0] * len(steps), f"{what}: rollout/logprob_diff/max per step {diffs}"
    for row in rows:
        assert row["rollout/logprob_diff/frac_diff"] == 0.0, (what, row["step"])
    # Updates happened in between (at most steps whose group rewards are all equal train on
    # zero advantages): otherwise the run proves nothing past its first step.
    updated = sum(r["actor/grad_norm"] > 0 for r in rows)
    assert updated >= len(rows) // 2, (what, [r["actor/grad_norm"] for r in rows])


LORA = ["model.lora_rank=4", "model.lora_alpha=8", "actor.optim.lr=1e-2"]
ONE_PROCESS = {"packed_dynamic": [], "padded": PADDED, "bf16": ["model.dtype=bfloat16"], "lora": LORA}
# Mixture of experts with routing replay (R3: the update replays the rollout's routes), experts
# split over the two ranks.
MOE_R3_EP2 = [
    "quickstart.family=qwen3_moe",
    "parallel.ep=2",
    "rollout.enable_rollout_routing_replay=true",
    "actor.megatron.router_replay.mode=R3",
]


@pytest.fixture(scope="module")
def one_process_rows(pool1, tmp_path_factory) -> dict:
    out_root = str(tmp_path_factory.mktemp("parity_steps"))
    return pool1.run(f"{__name__}:layouts_job", out_root=out_root, runs=ONE_PROCESS)[0]


def test_parity_holds_at_every_step_one_process(one_process_rows):
    for name in ONE_PROCESS:
        _assert_zero_every_step(one_process_rows[name], list(range(1, STEPS + 1)), name)


@pytest.mark.multiproc
def test_parity_holds_at_every_step_two_processes(pool2, tmp_path):
    runs = {
        "tp2": ["parallel.tp=2"],
        "pp2": ["parallel.pp=2"],
        "dp2": [],
        "moe_r3_ep2": MOE_R3_EP2,
        "lora_tp2": ["parallel.tp=2", *LORA],  # adapters' A sharded (row) and B sharded (column)
    }
    rows = pool2.run(f"{__name__}:layouts_job", out_root=str(tmp_path), runs=runs)[0]
    for name in runs:
        _assert_zero_every_step(rows[name], list(range(1, STEPS + 1)), name)


def test_parity_holds_across_a_resume(pool1, tmp_path, one_process_rows):
    out = pool1.run(f"{__name__}:resume_job", out_dir=str(tmp_path / "run"))[0]
    _assert_zero_every_step(out["first"], [1, 2], "before the resume")
    resumed = [r for r in out["resumed"] if r["step"] > 2]
    _assert_zero_every_step(resumed, [3, 4], "after the resume")
    # The resumed steps are the uninterrupted run's steps 3-4 (same config but the checkpoint).
    whole = one_process_rows["packed_dynamic"][2:]
    assert len(whole) == len(resumed) == 2
    for row_whole, row_resumed in zip(whole, resumed):
        for key in ("actor/grad_norm", "actor/pg_loss", "critic/score/mean", "response_length/mean"):
            assert row_resumed[key] == row_whole[key], (row_whole["step"], key)
