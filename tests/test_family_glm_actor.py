"""GLM-4.5 (glm4_moe) actor updates: every layout gives the one-process numbers; the expert bias moves.

The batch and actor settings of ``test_actor_update`` (compute_log_prob + update_policy, one
mini-batch of 8 rows in micro-batches of 2: one optimizer step) on tiny GLM-4.5 checkpoints
(grouped-query attention with q/k/v biases, QK-norm and partial rotary; a dense layer and a
sigmoid-routed layer with expert biases, as ``test_family_deepseek_actor``): the MoE one at ep=2
(with dp=2) and pp=2, a dense one (``first_k_dense_replace=2``) at tp=2 (megatron trains MoE layers
at tp > 1 only with sequence parallelism, a GPU feature). Log-probs and metrics must match the
single-process run within the float32 floor of ``test_actor_update``, the weights after one SGD step
of learning rate 1 within 1e-5 (``test_family_qwen3_next_actor``'s standard: with Adam, single
elements whose gradient is within float32 noise of Adam's epsilon moved by up to 2.6e-4 = 2.6% of
lr between padded and packed rows here, past the Adam tail bound), the expert biases exactly; packed
rows and dynamic micro-batches must match padded rows in one process; every expert bias must move by 1e-3 * sign(mean load - load) with the load counted by
transformers' router (DeepSeek-V3's aux-loss-free rule, which GLM-4.5 uses).
"""

from __future__ import annotations

import pytest
import torch

from tests.family_models import build_glm4_moe
from tests.helpers import saved_model
from tests.test_actor_update import VOCAB, merge
from tests.test_family_deepseek_actor import BIAS
from tests.test_family_deepseek_actor import (
    test_expert_bias_update_follows_the_load as _assert_bias_follows_load,
)
from tests.test_family_qwen3_next_actor import _assert_same_update

# (path, layout, variants) -> per-variant log-probs, metrics and weights after one SGD step of lr 1.
JOB = "tests.test_family_qwen3_next_actor:q3n_actor_job"

# Hidden 32, 4 query heads of 8 over 2 kv groups (4 rotating dims each); layer 1: 8 experts of 16.
GLM4_MOE_ACTOR = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
    initializer_range=0.1,
)  # fmt: skip


@pytest.fixture(scope="module")
def glm_moe_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_glm4_moe_actor", lambda p: build_glm4_moe(p, **GLM4_MOE_ACTOR))


@pytest.fixture(scope="module")
def glm_reference(pool1, glm_moe_path) -> dict:
    variants = ["padded", "packed", "dynamic"]
    return merge(pool1.run(JOB, path=glm_moe_path, layout={}, variants=variants))


def test_glm_packed_and_dynamic_rows_match_padded(glm_reference):
    assert glm_reference["padded"]["metrics"]["actor/pg_loss"][0] != 0.0
    for variant in ("packed", "dynamic"):
        _assert_same_update(glm_reference[variant], glm_reference["padded"])


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2)], ids=["ep2-dp2", "pp2"])
def test_glm_moe_layouts_match_single_process(pool2, glm_moe_path, glm_reference, layout):
    run = merge(pool2.run(JOB, path=glm_moe_path, layout=layout, variants=["padded"]))
    _assert_same_update(run["padded"], glm_reference["padded"])
    got, want = run["padded"]["weights"][BIAS], glm_reference["padded"]["weights"][BIAS]
    assert torch.equal(got, want), f"{layout}: expert bias differs by {float((got - want).abs().max()):.3g}"


def test_glm_dense_tp2_matches_single_process(pool1, pool2, tmp_path_factory):
    path = saved_model(
        tmp_path_factory,
        "tiny_glm4_dense_actor",
        lambda p: build_glm4_moe(p, **GLM4_MOE_ACTOR, first_k_dense_replace=2),
    )
    ref = merge(pool1.run(JOB, path=path, layout={}, variants=["padded"]))
    run = merge(pool2.run(JOB, path=path, layout=dict(tp=2), variants=["padded"]))
    _assert_same_update(run["padded"], ref["padded"])


def test_glm_expert_bias_update_follows_the_load(glm_moe_path, glm_reference):
    """The padded, packed and dynamic runs' biases: start + 1e-3 * sign(mean load - load), the load
    counted by transformers' router (DeepSeek-V3's check, run on this checkpoint)."""
    _assert_bias_follows_load(glm_moe_path, glm_reference)
