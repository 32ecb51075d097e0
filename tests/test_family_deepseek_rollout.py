"""DeepSeek-V3 in the native rollout engine: MLA decoding with a cache of the compressed latent.

A tiny DeepSeek-V3 (MLA with q/kv latents and YaRN, sigmoid-routed experts; vocabulary 96 as the
native-rollout tests' prompts) samples two responses per prompt (left-padded prompts of 1-7
tokens, 12 new tokens); every rollout log-prob must equal log-softmax(logits / T) of a cache-free
megatron forward of the same tokens within 1e-4 (float32), at tp=1, tp=2 and ep=2 (tp=2 and ep=2
must also sample tp=1's tokens with the same seed). The decoder's MLA cache holds kv_lora_rank +
rope numbers per token, row and layer on every tp rank: 4x (tp=1) and 2x (tp=2) less than the
decompressed per-head keys and values (4 heads x (nope 16 + rope 8 + value 16)) would.
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
    if chunks[0].config.multi_latent_attention:  # the job also serves other families' rollout tests
        sampled["cache"] = _cache_sizes(runtime, chunks)
    with torch.no_grad():
        sampled["recomputed"] = _recomputed_log_probs(chunks[0].eval(), sampled, SAMPLING["temperature"])
    return sampled


def _cache_sizes(runtime, chunks) -> dict:
    """Bytes per token, row and layer of the decoder's MLA cache, the latent's and the decompressed."""
    from verl_megatron.rollout.decode import ChunkDecoder, inference_mode_for

    rows, columns = 3, 10
    with inference_mode_for(chunks) as bare:
        decoder = ChunkDecoder(bare, runtime, rows, columns, 96)
    layers = [cache for chunk_cache in decoder.caches for cache in chunk_cache]
    cached = sum(t.numel() * t.element_size() for cache in layers for t in cache)
    attention, itemsize = chunks[0].decoder.layers[0].self_attention, torch.finfo(torch.float32).bits // 8
    config, heads = attention.config, attention.num_attention_heads_per_partition
    decompressed = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim) * itemsize
    latent = (config.kv_lora_rank + config.qk_pos_emb_head_dim) * itemsize
    return {
        "per_token": cached / (rows * columns * len(layers)),
        "latent": latent,
        "decompressed": decompressed,
    }


def _assert_latent_cache(run: dict, tp: int, what: str) -> None:
    sizes = run["cache"]
    assert sizes["per_token"] == sizes["latent"] == (32 + 8) * 4, f"{what}: cache bytes per token {sizes}"
    ratio = sizes["decompressed"] / sizes["per_token"]
    assert ratio == 4 / tp, f"{what}: the decompressed cache would be {ratio}x the latent's, not {4 / tp}x"


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
    _assert_latent_cache(mla_single, 1, "tp=1")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2)], ids=["tp2", "ep2"])
def test_mla_rollout_layouts_sample_tp1_tokens(pool2, mla_single, mla_model, layout):
    runs = pool2.run(f"{__name__}:mla_rollout_job", model_dir=mla_model, layout=layout)
    for rank, run in enumerate(runs):
        _assert_log_probs_recomputed(run, f"{layout} rank {rank}")
        _assert_latent_cache(run, layout.get("tp", 1), f"{layout} rank {rank}")
        assert torch.equal(run["responses"], mla_single["responses"]), f"{layout} rank {rank}: other tokens"
