"""configs/grpo_deepseek_v3.yaml trains a step on a tiny GLM-4.5 (glm4_moe) too, as its header says.

The recipe as written (bf16, native rollout with routing replay R3, dynamic micro-batches,
expert-bias updates, validation, a checkpoint) with only sizes overridden, on a tiny random GLM-4.5
(grouped-query attention with partial rotary, a dense layer, a sigmoid-routed MoE layer) with the
DeepSeek-V3 recipe test's tokenizer and GSM8K-style rows; its step checks (finite metrics, replayed
routes agreeing on 90% or more of the tokens, a checkpoint, validation) hold.
"""

from __future__ import annotations

import pytest

from tests.family_models import build_glm4_moe
from tests.test_family_deepseek_recipe import family_recipe_assets
from tests.test_family_deepseek_recipe import (
    test_grpo_deepseek_v3_recipe_runs_a_step as _assert_recipe_runs_a_step,
)


@pytest.fixture(scope="module")
def glm_assets(tmp_path_factory) -> dict[str, str]:
    return family_recipe_assets(
        tmp_path_factory.mktemp("glm4_recipe"),
        lambda path, **ids: build_glm4_moe(
            path, hidden_size=32, moe_intermediate_size=16, intermediate_size=64, head_dim=8, **ids
        ),
    )


def test_grpo_deepseek_v3_recipe_runs_a_glm_step(pool1, glm_assets, tmp_path):
    _assert_recipe_runs_a_step(pool1, glm_assets, tmp_path)
