"""Qwen3-Next checkpoints: megatron (gated DeltaNet + gated attention + MoE) reproduces transformers.

A tiny random Qwen3-Next (``tests/qwen3_next_models.py``: DeltaNet and gated-attention layers
alternating, a dense first layer, 4 experts with a gated shared expert, zero-centred norms,
random norm weights, ``A_log`` and ``dt_bias``) and Qwen3.5 text decoders of the same shapes
(MoE at tp=1 and tp=2, dense at tp=1) are loaded by ``load_hf_weights``. float32 logits
must equal transformers' to 1e-4 at tp=1, tp=2 (DeltaNet heads split over tp), pp=2 and ep=2, and
the export (tp=2: the tp-dependent fused layout; ep=2 x... pp=2) must be byte-identical to the
file it was loaded from. The torch gated delta rule (chunked and token by token) must equal
transformers' torch reference, and the GPU kernel path's glue (fla / causal-conv1d stand-ins with
their signatures) must give the torch path's logits.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch

from tests.helpers import hf_reference_logits
from tests.qwen3_next_models import build_qwen3_5, build_qwen3_next
from tests.test_family_deepseek import _assert_matches
from tests.test_models_parity import SEQUENCES


@pytest.fixture(scope="module")
def q3n_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_qwen3_next")
    build_qwen3_next(str(root / "moe"))
    build_qwen3_5(str(root / "qwen3_5_moe"), moe=True)
    return {"moe": str(root / "moe"), "qwen3_5_moe": str(root / "qwen3_5_moe")}


@pytest.fixture(scope="module")
def q35_dense(tmp_path_factory) -> dict[str, str]:
    path = str(tmp_path_factory.mktemp("tiny_qwen3_5") / "dense")
    build_qwen3_5(path, moe=False)
    return {"qwen3_5_dense": path}


@pytest.fixture(scope="module")
def q3n_reference(q3n_models) -> dict[str, list[torch.Tensor]]:
    return hf_reference_logits(q3n_models, SEQUENCES)


def test_gated_delta_rule_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from verl_megatron.models.families.gated_delta_rule import (
        chunk_gated_delta_rule,
        l2_normalize,
        recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 70, 4, 8, 6  # 70 tokens: two chunks of 64, the second padded
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v, state = torch.randn(b, t, h, dv, generator=gen), torch.randn(b, h, dk, dv, generator=gen)
    g, beta = -torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    want, want_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    for rule in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        got, got_state = rule(l2_normalize(q), l2_normalize(k), v, g, beta, state)
        for what, x, y in (("outputs", got, want), ("state", got_state, want_state)):
            diff = (x - y).abs()
            where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
            assert diff.max() <= 1e-5, f"{rule.__name__} {what}: max diff {diff.max():.3g} at {where}"


def test_qwen3_next_logits_match_transformers_one_process(pool1, q3n_models, q3n_reference, q35_dense):
    paths = {**q3n_models, **q35_dense}
    (results,) = pool1.run("tests.test_moe_models:moe_parity_job", paths=paths, layout={})
    _assert_matches(results, {**q3n_reference, **hf_reference_logits(q35_dense, SEQUENCES)})


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(ep=2)], ids=["tp2", "pp2", "ep2"])
def test_qwen3_next_logits_match_and_export_round_trips(pool2, q3n_models, q3n_reference, layout, tmp_path):
    # Qwen3.5 differs in the tp-dependent in_proj layout only: checked at tp=2.
    paths = q3n_models if "tp" in layout else {"moe": q3n_models["moe"]}
    results = pool2.run(
        "tests.test_moe_models:moe_parity_job", paths=paths, layout=layout, export_dir=str(tmp_path)
    )
    assert set(results[-1]) == set(paths)
    _assert_matches(results[-1], q3n_reference)
    if layout.get("pp", 1) == 1:
        _assert_matches(results[0], q3n_reference)
    for name, path in paths.items():
        original, exported = os.path.join(path, "model.safetensors"), tmp_path / name / "model.safetensors"
        assert filecmp.cmp(original, exported, shallow=False), f"{name} ({layout}): export differs"


def fla_glue_job(path: str) -> tuple[float, int]:
    """Max |logits with the GPU kernel path - torch path|, the kernels replaced by torch stand-ins
    with fla's and causal-conv1d's signatures (no GPU here): checks the glue around the calls."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.families import gated_delta_rule, qwen3_next_layers
    from verl_megatron.tools.check_hf import megatron_logits

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):  # fmt: skip
        assert scale is None and initial_state is None and not use_qk_l2norm_in_kernel
        calls.append(q.shape)
        assert q.dtype == k.dtype == v.dtype and all(t.is_contiguous() for t in (q, k, v, beta))
        out, state = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta)
        return out.to(v.dtype), state if output_final_state else None

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
        assert weight.dim() == 2 and x.shape[1] == weight.shape[0] and x.is_contiguous()
        assert activation == "silu" and bias is None and initial_states is None
        return gated_delta_rule.causal_conv(
            x, weight.unsqueeze(1), x.new_zeros(*x.shape[:2], weight.shape[1] - 1)
        )

    calls: list = []
    runtime = init_runtime(ParallelLayout())
    chunks = build_gpt_chunks(load_hf_config(path), runtime, ModelConfig(path=path, dtype="float32"))
    load_hf_weights(chunks, path, runtime)
    torch_path = megatron_logits(chunks, runtime, SEQUENCES)
    real = qwen3_next_layers.fast_kernels
    qwen3_next_layers.fast_kernels = lambda x: (chunk_gated_delta_rule, causal_conv1d_fn)
    try:  # the pool's worker process lives on: put the real selector back
        kernel_path = megatron_logits(chunks, runtime, SEQUENCES)
    finally:
        qwen3_next_layers.fast_kernels = real
    return max(float((a - b).abs().max()) for a, b in zip(torch_path, kernel_path, strict=True)), len(calls)


def test_kernel_path_glue_matches_torch_path(pool1, q3n_models):
    ((diff, calls),) = pool1.run(f"{__name__}:fla_glue_job", path=q3n_models["moe"])
    assert calls == 2 * len(SEQUENCES)  # both DeltaNet layers, every sequence
    assert diff <= 1e-5, f"logits through the kernel calls differ from the torch path by {diff:.3g}"
