"""DeepSeek-V3 in the native rollout engine: MLA decoding with a cache of decompressed keys/values.

A tiny DeepSeek-V3 (MLA with q/kv latents and YaRN, sigmoid-routed experts; vocabulary 96 as the
native-rollout tests' prompts) samples two responses per prompt (left-padded prompts of 1-7
tokens, 12 new tokens); every rollout log-prob must equal log-softmax(logits / T) of a cache-free
megatron forward of the same tokens within 1e-4 (float32), at tp=1, tp=2 and ep=2 (tp=2 and ep=2
must also sample tp=1's tokens with the same seed).
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import max_abs_diff
from tests.family_models import YARN, build_deepseek_v3
from tests.helpers import saved_model
from tests.test_rollout_native import SAMPLING, _engine, _recomputed_log_probs, _result, prompt_batch


def mla_rollout_job(model_dir: str, layout: dict) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights

    runtime, hf_config = init_runtime(ParallelLayout(**layout), seed=11), load_hf_config(model_dir)
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=model_dir, dtype="float32"))
    load_hf_weights(chunks, model_dir, runtime)
    engine = _engine(runtime, chunks, hf_config, **SAMPLING)
    sampled = _result(engine.generate_sequences(prompt_batch()))
    with torch.no_grad():
        sampled["recomputed"] = _recomputed_log_probs(chunks[0].eval(), sampled, SAMPLING["temperature"])
    return sampled


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    return saved_model(
        tmp_path_factory,
        "tiny_dsv3_rollout",
        lambda p: build_deepseek_v3(p, vocab_size=96, rope_parameters=YARN),
    )


@pytest.fixture(scope="module")
def mla_single(pool1, mla_model) -> dict:
    (result,) = pool1.run(f"{__name__}:mla_rollout_job", model_dir=mla_model, layout={})
    return result


def _assert_log_probs_recomputed(run: dict, what: str) -> None:
    mask = run["response_mask"].bool()
    assert mask.sum() == mask.numel()  # ignore_eos: every response is full length
    diff = max_abs_diff(run["rollout_log_probs"][mask], run["recomputed"][mask])
    assert diff <= 1e-4, f"{what}: rollout log-probs differ from a full forward by {diff:.3g}"


def test_mla_rollout_log_probs_equal_full_forward(mla_single):
    _assert_log_probs_recomputed(mla_single, "tp=1")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2)], ids=["tp2", "ep2"])
def test_mla_rollout_layouts_sample_tp1_tokens(pool2, mla_single, mla_model, layout):
    runs = pool2.run(f"{__name__}:mla_rollout_job", model_dir=mla_model, layout=layout)
    for rank, run in enumerate(runs):
        _assert_log_probs_recomputed(run, f"{layout} rank {rank}")
        assert torch.equal(run["responses"], mla_single["responses"]), f"{layout} rank {rank}: other tokens"
