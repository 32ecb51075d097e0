"""Qwen3-Next in the native rollout engine: DeltaNet conv + recurrent states and gated attention.

A tiny Qwen3-Next (DeltaNet / gated attention alternating, MoE; vocabulary 96 as the native-rollout
tests' prompts) samples two responses per prompt (left-padded prompts of 1-7 tokens, 12 new
tokens: the prefill's padding must leave the states at zero, the n samples copy them, each step
advances them by one token); every rollout log-prob must equal log-softmax(logits / T) of a
cache-free megatron forward of the same tokens within 1e-4 (float32), at tp=1 and tp=2 (each tp
rank holds the states of its DeltaNet heads; tp=2 must also sample tp=1's tokens). The checkpoint
has no padding id, so the padding token's embedding is not zero: without the prefill's masking
the states pick it up (measured: log-probs off by 6.2).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import saved_model
from tests.qwen3_next_models import build_qwen3_next
from tests.test_family_deepseek_rollout import _assert_log_probs_recomputed


@pytest.fixture(scope="module")
def q3n_model(tmp_path_factory) -> str:
    return saved_model(
        tmp_path_factory, "tiny_q3n_rollout", lambda p: build_qwen3_next(p, vocab_size=96, pad_token_id=None)
    )


@pytest.fixture(scope="module")
def q3n_single(pool1, q3n_model) -> dict:
    (result,) = pool1.run(
        "tests.test_family_deepseek_rollout:mla_rollout_job", model_dir=q3n_model, layout={}
    )
    return result


def test_qwen3_next_rollout_log_probs_equal_full_forward(q3n_single):
    _assert_log_probs_recomputed(q3n_single, "tp=1")


def test_qwen3_next_rollout_tp2_samples_tp1_tokens(pool2, q3n_single, q3n_model):
    runs = pool2.run(
        "tests.test_family_deepseek_rollout:mla_rollout_job", model_dir=q3n_model, layout=dict(tp=2)
    )
    for rank, run in enumerate(runs):
        _assert_log_probs_recomputed(run, f"tp=2 rank {rank}")
        assert torch.equal(run["responses"], q3n_single["responses"]), f"tp=2 rank {rank}: other tokens"
