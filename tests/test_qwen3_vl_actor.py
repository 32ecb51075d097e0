"""Qwen3-VL through MegatronActor: test_vl_actor's four image + text rows on the tiny Qwen3-VL.

``tests/test_vl_actor.py``'s job (compute_log_prob, then one update_policy with SGD at learning
rate 1 and clipping at 1.0, so weight differences are gradient differences) on the tiny Qwen3-VL
(DeepStack after decoder layers 0 and 1 of 4): tp=2 and pp=2 (layers 0-1 with the tower and
DeepStack on stage 0) must give the one-process log-probs and weights within 1e-5; the LM head of
the log-prob pass sees response positions only; ``model.freeze_vision_tower`` keeps the tower,
DeepStack mergers included, out of Adam and unchanged bit for bit. Token-budget micro-batches of
packed rows give the same update too. Measured vs one process (log-probs / weights after SGD):
tp=2 9.5e-7 / 1.2e-7, pp=2 4.8e-7 / 1.2e-7, packed 9.5e-7 / 1.2e-7. The 1e-5 bound is
test_vl_actor's: about 2x float32's distance to float64 on these rows' gradients (5.4e-6,
tests/test_vl_packing.py); the actor itself has no float64 mode (model.dtype float32 | bfloat16).
"""

from __future__ import annotations

import pytest

import tests.test_vl_actor as qwen2_5_vl_actor
from tests.closeness import assert_close_report, max_abs_diff
from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen3_vl

JOB = "tests.test_vl_actor:vl_actor_job"
TR = qwen2_5_vl_actor.TR


@pytest.fixture(scope="module")
def qwen3_vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen3_vl_actor", build_tiny_qwen3_vl)


def _print_diffs(run: dict, ref: dict, what: str) -> None:
    print(
        f"qwen3_vl {what}: log-probs {max_abs_diff(run['old_log_probs'], ref['old_log_probs']):.2e}, "
        f"weights after SGD {max_abs_diff(run['weights'], ref['weights']):.2e}"
    )


@pytest.fixture(scope="module")
def single(pool1, qwen3_vl_path) -> dict:
    (run,) = pool1.run(JOB, path=qwen3_vl_path, layout={}, variants=["mb2", "dynamic"])
    return run


def test_qwen3_vl_update_trains_tower_and_deepstack_and_heads_see_responses_only(single):
    packed, single = single["dynamic"], single["mb2"]
    assert single["old_log_probs"].abs().max() > 1.0 and single["metrics"]["actor/pg_loss"][0] != 0.0
    moved = {n: float((w - single["before"][n]).abs().max()) for n, w in single["weights"].items()}
    deepstack = [n for n in moved if "deepstack_merger_list" in n]
    vision = [n for n in moved if ".visual." in n or n.startswith("visual.")]
    assert len(deepstack) == 12 and min(moved[n] for n in deepstack) > 1e-4, deepstack
    assert len(vision) > 20 and max(moved[n] for n in vision) > 1e-3
    # Log-prob pass: the LM head gets 2 micro-batches x 2 rows x TR response positions, nothing else.
    rows = single["head_rows"]
    assert sum(rows) == 4 * TR and max(rows) <= 2 * TR and rows.count(2 * TR) == 2, rows
    # Token-budget micro-batches of packed rows (the budget counts image tokens) give the same update.
    assert len([r for r in packed["head_rows"] if r]) >= 3, packed["head_rows"]
    qwen2_5_vl_actor._assert_same_update(packed, single, "qwen3_vl packed token-budget micro-batches")
    _print_diffs(packed, single, "packed")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)], ids=["tp2", "pp2"])
def test_qwen3_vl_update_at_tp2_and_pp2_equals_one_process(pool2, qwen3_vl_path, single, layout):
    ranks = pool2.run(JOB, path=qwen3_vl_path, layout=layout, variants=["mb2"])
    single = single["mb2"]
    qwen2_5_vl_actor._assert_same_update(ranks[0]["mb2"], single, f"qwen3_vl {layout} rank 0")
    _print_diffs(ranks[0]["mb2"], single, str(layout))
    assert_close_report(
        ranks[1]["mb2"]["old_log_probs"], single["old_log_probs"], rtol=0, atol=1e-5, what=f"{layout} rank 1"
    )


def test_qwen3_vl_freeze_vision_tower_keeps_tower_and_deepstack_out_of_adam(pool1, qwen3_vl_path):
    (run,) = pool1.run(JOB, path=qwen3_vl_path, layout={}, variants=["mb2"], freeze=True)
    record = run["mb2"]
    assert record["state_params"] and not [n for n in record["optimizer_params"] if "vision." in n]
    assert any(n.endswith("embedding.word_embeddings.weight") for n in record["optimizer_params"])
    tower = [n for n in record["weights"] if ".visual." in n or n.startswith("visual.")]
    assert len([n for n in tower if "deepstack_merger_list" in n]) == 12
    for name, weight in record["weights"].items():
        moved = float((weight - record["before"][name]).abs().max())
        assert (moved == 0.0) == (name in tower), f"{name} moved by {moved:.3e}"
