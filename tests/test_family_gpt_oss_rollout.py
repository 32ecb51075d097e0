"""GPT-OSS in the native rollout engine: cached decoding with attention sinks and sliding windows.

The tiny GPT-OSS of ``tests/family_gpt_oss.py`` (vocabulary 96 as the native-rollout tests'
prompts; layer 0 sees the 4 latest tokens, layer 1 all) samples two responses per left-padded
prompt of 1-7 tokens, 12 new tokens each: most positions lie beyond the window. Every rollout
log-prob must equal log-softmax(logits / T) of a cache-free megatron forward (the training
attention) of the same tokens within 1e-4 (float32), at tp=1, tp=2 (expert tp 1) and ep=2; the
two-process layouts must sample tp=1's tokens with the same seed.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_gpt_oss import build_gpt_oss
from tests.helpers import saved_model
from tests.test_family_deepseek_rollout import _assert_log_probs_recomputed

# (model_dir, layout) -> sampled rows with their rollout and recomputed log-probs.
JOB = "tests.test_family_deepseek_rollout:mla_rollout_job"


@pytest.fixture(scope="module")
def oss_rollout_model(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_gpt_oss_rollout", lambda p: build_gpt_oss(p, vocab_size=96))


@pytest.fixture(scope="module")
def oss_single(pool1, oss_rollout_model) -> dict:
    (result,) = pool1.run(JOB, model_dir=oss_rollout_model, layout={})
    return result


def test_gpt_oss_rollout_log_probs_equal_full_forward(oss_single):
    assert oss_single["responses"].shape[1] == 12 and oss_single["prompts"].shape[1] > 4  # past the window
    _assert_log_probs_recomputed(oss_single, "tp=1")


@pytest.mark.parametrize("layout", [dict(tp=2, etp=1), dict(ep=2)], ids=["tp2", "ep2"])
def test_gpt_oss_rollout_layouts_sample_tp1_tokens(pool2, oss_single, oss_rollout_model, layout):
    runs = pool2.run(JOB, model_dir=oss_rollout_model, layout=layout)
    for rank, run in enumerate(runs):
        _assert_log_probs_recomputed(run, f"{layout} rank {rank}")
        assert torch.equal(run["responses"], oss_single["responses"]), f"{layout} rank {rank}: other tokens"
