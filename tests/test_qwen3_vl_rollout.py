"""Native rollout of image + text prompts on the tiny Qwen3-VL (interleaved 3-D rope, DeepStack in
the prefill): log-probs equal the actor's.

``tests/test_vl_rollout.py``'s job and checks on a Qwen3-VL folder: three prompts (one image, two
images, text only) x n=2, 6 response tokens; the rollout's log-probs must equal the actor's
``compute_log_prob`` of its output within 1e-4 (float32), the vision tower runs once per call
(on the three images), the output's 3-D ids continue each prompt's; at tp=1 and tp=2. Measured
1.4e-6 at tp=1; with the prefill's DeepStack additions left out the difference is 0.49.
"""

from __future__ import annotations

import pytest

import tests.test_vl_rollout as qwen2_5_vl_rollout
from tests.closeness import assert_close_report
from tests.helpers import saved_model
from verl_megatron.utils.local_vl_assets import build_tiny_qwen3_vl

JOB = "tests.test_vl_rollout:vl_rollout_job"


@pytest.fixture(scope="module")
def qwen3_vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen3_vl_rollout", build_tiny_qwen3_vl)


def test_qwen3_vl_native_rollout_matches_the_actor_at_tp1_and_tp2(pool1, pool2, qwen3_vl_path):
    (single,) = pool1.run(JOB, path=qwen3_vl_path, tp=1)
    qwen2_5_vl_rollout._check(single, "qwen3_vl tp=1")
    ranks = pool2.run(JOB, path=qwen3_vl_path, tp=2)
    for rank, run in enumerate(ranks):
        qwen2_5_vl_rollout._check(run, f"qwen3_vl tp=2 rank {rank}")
    assert_close_report(ranks[0]["rollout"], single["rollout"], atol=1e-4, rtol=0, what="tp=2 vs tp=1")
