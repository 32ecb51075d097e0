"""GLM-4.5 (glm4_moe) checkpoints: megatron reproduces transformers and round-trips the weights.

A tiny random GLM-4.5 (``tests/family_models.py``): grouped-query attention with q/k/v biases,
QK-norm and half of each head rotating (``partial_rotary_factor`` 0.5), a dense first layer and
DeepSeek-V3's routing (sigmoid scores, ``e_score_correction_bias``, 8 experts in 4 groups, a
shared expert, ``routed_scaling_factor``). float32 logits must equal transformers' within 1e-4
at tp=1, ep=2, tp=2 and pp=2; the export after each two-process load must be byte-identical to the
loaded file; native-rollout log-probs must equal a cache-free forward within 1e-4.
"""

from __future__ import annotations

import filecmp
import os

import pytest

from tests.family_models import build_glm4_moe
from tests.helpers import hf_reference_logits, saved_model
from tests.test_family_deepseek import _assert_matches
from tests.test_family_deepseek_rollout import _assert_log_probs_recomputed
from tests.test_models_parity import SEQUENCES


@pytest.fixture(scope="module")
def glm_models(tmp_path_factory) -> dict[str, str]:
    return {"glm4_moe": saved_model(tmp_path_factory, "tiny_glm4_moe", build_glm4_moe)}


def test_glm_logits_match_transformers(pool1, pool2, glm_models, tmp_path):
    reference = hf_reference_logits(glm_models, SEQUENCES)
    (single,) = pool1.run("tests.test_moe_models:moe_parity_job", paths=glm_models, layout={})
    _assert_matches(single, reference)
    original = os.path.join(glm_models["glm4_moe"], "model.safetensors")
    for layout in (dict(ep=2), dict(tp=2), dict(pp=2)):
        export = str(tmp_path / "_".join(f"{k}{v}" for k, v in layout.items()))
        ranks = pool2.run(
            "tests.test_moe_models:moe_parity_job", paths=glm_models, layout=layout, export_dir=export
        )
        assert set(ranks[-1]) == {"glm4_moe"}, layout
        for result in ranks if layout.get("pp", 1) == 1 else ranks[-1:]:
            _assert_matches(result, reference)
        exported = os.path.join(export, "glm4_moe", "model.safetensors")
        assert filecmp.cmp(original, exported, shallow=False), f"{layout}: export differs from {original}"


def test_glm_rollout_log_probs_equal_full_forward(pool1, tmp_path_factory):
    # Vocabulary 96: the native-rollout tests' prompts and log-prob recomputation.
    path = saved_model(tmp_path_factory, "tiny_glm4_rollout", lambda p: build_glm4_moe(p, vocab_size=96))
    (run,) = pool1.run("tests.test_family_deepseek_rollout:mla_rollout_job", model_dir=path, layout={})
    _assert_log_probs_recomputed(run, "glm4_moe tp=1")
