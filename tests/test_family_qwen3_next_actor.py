"""Qwen3-Next actor updates: every layout gives the one-process numbers; packed rows reset the state.

The batch and actor settings of ``test_actor_update`` (compute_log_prob + update_policy, one
mini-batch of 8 rows in micro-batches of 2: one optimizer step) on tiny Qwen3-Next checkpoints
(vocabulary 63): the MoE one (DeltaNet / gated attention alternating, a dense first layer, 4
experts) at ep=2 (with dp=2), and a dense one (``num_experts=0``) at tp=2, where each tp rank
runs its share of the DeltaNet key/value heads (megatron trains MoE layers at tp > 1 only with
sequence parallelism, a GPU feature). Log-probs, metrics and the updated weights must match the
single-process run: log-probs and metrics within ``test_actor_update``'s float32 floor, the weights
after one SGD step of learning rate 1 (so weight differences are gradient differences; Adam's
first step maps a gradient within float32 noise of its epsilon to anything in [-lr, lr], which a
few of these models' 30k weights hit) within WEIGHT_ATOL. Packed rows (one row of several
sequences: the DeltaNet state must restart at each) must give the padded rows' numbers.
"""

from __future__ import annotations

import pytest

from tests.closeness import assert_close_report
from tests.helpers import saved_model
from tests.qwen3_next_models import build_qwen3_next
from tests.test_actor_update import VARIANTS, build_actor, kl_actor_config, kl_update_record, merge

WEIGHT_ATOL = 1e-5


def _assert_same_update(run: dict, ref: dict) -> None:
    for key, atol in (("old_log_probs", 1e-5), ("metrics", 1e-6)):
        assert_close_report(
            run[key], ref[key], rtol=1e-5 if key == "old_log_probs" else 1e-4, atol=atol, what=key
        )
    assert_close_report(run["weights"], ref["weights"], rtol=0, atol=WEIGHT_ATOL, what="weights after SGD")


def q3n_actor_job(path: str, layout: dict, variants: list[str]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.workers.config import OptimConfig

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    out = {}
    sgd = OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=1.0)
    for variant in variants:
        cfg = kl_actor_config(
            ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8, optim=sgd, **VARIANTS[variant]
        )
        chunks, actor = build_actor(runtime, path, cfg)
        out[variant] = kl_update_record(runtime, chunks, actor)
    return out


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return saved_model(
        tmp_path_factory, "tiny_q3n_moe", lambda p: build_qwen3_next(p, vocab_size=63, initializer_range=0.1)
    )


@pytest.fixture(scope="module")
def moe_reference(pool1, moe_path) -> dict:
    return merge(
        pool1.run(f"{__name__}:q3n_actor_job", path=moe_path, layout={}, variants=["padded", "packed"])
    )


def test_packed_rows_match_padded(moe_reference):
    assert moe_reference["padded"]["metrics"]["actor/pg_loss"][0] != 0.0
    _assert_same_update(moe_reference["packed"], moe_reference["padded"])


def test_moe_ep2_matches_single_process(pool2, moe_path, moe_reference):
    run = merge(pool2.run(f"{__name__}:q3n_actor_job", path=moe_path, layout=dict(ep=2), variants=["padded"]))
    _assert_same_update(run["padded"], moe_reference["padded"])


def test_dense_tp2_matches_single_process(pool1, pool2, tmp_path_factory):
    path = saved_model(
        tmp_path_factory,
        "tiny_q3n_dense",
        lambda p: build_qwen3_next(p, vocab_size=63, num_experts=0, initializer_range=0.1),
    )
    ref = merge(pool1.run(f"{__name__}:q3n_actor_job", path=path, layout={}, variants=["padded"]))
    run = merge(pool2.run(f"{__name__}:q3n_actor_job", path=path, layout=dict(tp=2), variants=["padded"]))
    _assert_same_update(run["padded"], ref["padded"])
