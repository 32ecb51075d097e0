"""Mixture-of-experts checkpoints: megatron reproduces transformers and round-trips the weights.

Tiny random Qwen3-MoE (top-k renormalised, a dense layer among MoE ones), Qwen2-MoE (gated
shared expert, q/k/v biases, no renormalisation) and Mixtral checkpoints are loaded into
megatron's MoE layer under ep=1, ep=2, tp=2 (experts split over tp), ep=2 x tp=2 with
expert tensor parallelism 1, and pp=2; float32 logits must equal transformers' to 1e-4. The
export is byte-identical to the ``save_pretrained`` file it came from, under ep=2 and pp=2.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import hf_reference_logits, save_tiny_models
from tests.test_models_parity import SEQUENCES, make_tiny_model

MOE_CASES: dict[str, dict] = {
    # Layer 1 of 3 is dense (mlp_only_layers): megatron's moe_layer_freq pattern must follow it.
    "qwen3_moe_norm_topk": dict(
        family="qwen3_moe", num_kv_heads=2, vocab_size=131, num_layers=2, norm_topk_prob=True,
        mlp_only_layers=[1], intermediate_size=96,
    ),
    "qwen2_moe_shared": dict(family="qwen2_moe", num_kv_heads=2, vocab_size=128, num_layers=2),
    "mixtral": dict(family="mixtral", num_kv_heads=2, vocab_size=128, num_layers=2, intermediate_size=64),
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("tiny_moe"), MOE_CASES, make_tiny_model)


@pytest.fixture(scope="module")
def moe_reference(moe_models) -> dict[str, list[torch.Tensor]]:
    return hf_reference_logits(moe_models, SEQUENCES)


def moe_parity_job(paths: dict[str, str], layout: dict, export_dir: str | None = None) -> dict:
    """On every rank: build + load each checkpoint under ``layout``; logits (None off the last
    stage) and, with ``export_dir``, export each model to ``export_dir/<name>``."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import export_hf_weights, load_hf_weights
    from verl_megatron.tools.check_hf import megatron_logits

    runtime = init_runtime(ParallelLayout(**layout))
    out = {}
    for name, path in paths.items():
        hf_config = load_hf_config(path)
        chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=path, dtype="float32"))
        load_hf_weights(chunks, path, runtime)
        out[name] = megatron_logits(chunks, runtime, SEQUENCES)
        if export_dir:
            export_hf_weights(chunks, runtime, os.path.join(export_dir, name), hf_config)
    return out


def _assert_matches(results: dict, reference: dict) -> None:
    for name, expected in reference.items():
        for got, want in zip(results[name], expected, strict=True):
            assert want.abs().max() > 1.0  # logits of a realistic size, so atol is meaningful
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_moe_logits_match_transformers_one_process(pool1, moe_models, moe_reference):
    (results,) = pool1.run(f"{__name__}:moe_parity_job", paths=moe_models, layout={})
    _assert_matches(results, moe_reference)


@pytest.mark.parametrize(
    "layout",
    [dict(ep=2), dict(tp=2), dict(tp=2, ep=2, etp=1), dict(pp=2)],
    ids=["ep2", "tp2", "tp2-ep2-etp1", "pp2"],
)
def test_moe_logits_match_transformers_two_processes(pool2, moe_models, moe_reference, layout):
    results = pool2.run(f"{__name__}:moe_parity_job", paths=moe_models, layout=layout)
    last = results[-1]
    _assert_matches(last, moe_reference)
    if layout.get("pp", 1) == 1:
        _assert_matches(results[0], moe_reference)


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2, etp=1)], ids=["ep2", "pp2"])
def test_moe_export_is_byte_identical(pool2, moe_models, tmp_path, layout):
    pool2.run(f"{__name__}:moe_parity_job", paths=moe_models, layout=layout, export_dir=str(tmp_path))
    for name, path in moe_models.items():
        with open(os.path.join(path, "model.safetensors"), "rb") as f:
            original = f.read()
        with open(tmp_path / name / "model.safetensors", "rb") as f:
            exported = f.read()
        assert exported == original, f"{name}: export differs from the checkpoint it was loaded from"


def check_hf_job(path: str, flags: list[str]) -> int:
    from verl_megatron.tools.check_hf import main

    return main([path, *flags])


def test_check_hf_runs_moe_models_under_expert_parallelism(pool2, moe_models):
    statuses = pool2.run(f"{__name__}:check_hf_job", path=moe_models["qwen2_moe_shared"], flags=["--ep", "2"])
    assert statuses == [0, 0]
    # Bad layouts are one-line errors before anything is built (status 2 from report_user_error).
    bad = pool2.run(f"{__name__}:check_hf_job", path=moe_models["mixtral"], flags=["--ep", "2", "--etp", "2"])
    assert all(status != 0 for status in bad)


def test_bad_expert_layouts_name_the_problem(moe_models):
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import check_model_fits

    path = moe_models["qwen3_moe_norm_topk"]  # 4 experts
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by ep=3"):
        check_model_fits(ParallelLayout(ep=3).resolve(3), path)
    with pytest.raises(ConfigError, match=r"training a mixture-of-experts model with tp=2 needs model.seq"):
        check_model_fits(ParallelLayout(tp=2, ep=2, etp=1).resolve(2), path)
    check_model_fits(ParallelLayout(tp=2, ep=2, etp=1).resolve(2), path, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"parallel.ep=4 must divide dp\*cp\*tp = 2"):
        ParallelLayout(ep=4).resolve(2)
    with pytest.raises(
        ValueError, match=r"parallel.ep\*etp = 2\*2 = 4 \(etp defaults to tp\) must divide dp\*cp\*tp = 2"
    ):
        ParallelLayout(tp=2, ep=2).resolve(2)
    with pytest.raises(ValueError, match=r"parallel.etp must be a positive integer"):
        ParallelLayout(ep=2, etp=0).resolve(2)
