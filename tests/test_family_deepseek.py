"""DeepSeek-V3 checkpoints: megatron (MLA + sigmoid group-limited routing) reproduces transformers.

Tiny random DeepSeek-V3 checkpoints (``tests/family_models.py``) are loaded by ``load_hf_weights``:
multi-latent attention with q/kv latents, YaRN rotary scaling with mscale, a first dense layer,
8 routed experts in 4 groups with an ``e_score_correction_bias`` large enough to change the
choice, one shared expert and ``routed_scaling_factor``; and a dense MLA model without a query
latent (``q_lora_rank=None``). float32 logits must equal transformers' to 1e-4 at tp=1, tp=2,
pp=2, ep=2 and ep=2 x pp=2 (4 processes, where a tiny GLM-4.5, GPT-OSS and Qwen3-Next are
checked too), and the export
(under ep=2 and pp=2) must be byte-identical to the file it was loaded
from, the expert biases included.
"""

from __future__ import annotations

import filecmp
import os

import pytest
import torch

from tests.family_gpt_oss import build_gpt_oss
from tests.family_models import YARN, build_deepseek_v3, build_glm4_moe
from tests.helpers import hf_reference_logits
from tests.qwen3_next_models import build_qwen3_next
from tests.test_models_parity import SEQUENCES

CASES = {
    "moe_yarn": dict(rope_parameters=YARN),
    "dense_no_q_latent": dict(q_lora_rank=None, first_k_dense_replace=2),
}


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_deepseek")
    paths = {}
    for name, overrides in CASES.items():
        paths[name] = str(root / name)
        build_deepseek_v3(paths[name], **overrides)
    return paths


@pytest.fixture(scope="module")
def ds_reference(ds_models) -> dict[str, list[torch.Tensor]]:
    return hf_reference_logits(ds_models, SEQUENCES)


def _moe_only(paths: dict[str, str], layout: dict) -> dict[str, str]:
    """Expert parallelism needs experts: the dense case is left out of ep layouts."""
    return {n: p for n, p in paths.items() if layout.get("ep", 1) == 1 or n.startswith("moe")}


def _assert_matches(results: dict, reference: dict) -> None:
    for name, expected in reference.items():
        if name not in results:
            continue
        for i, (got, want) in enumerate(zip(results[name], expected, strict=True)):
            assert want.abs().max() > 1.0  # logits of a realistic size, so atol is meaningful
            diff = float((got - want).abs().max())
            assert diff <= 1e-4, f"{name} sequence {i}: max |megatron - transformers| = {diff:.3g}"


def test_deepseek_logits_match_transformers_one_process(pool1, ds_models, ds_reference):
    (results,) = pool1.run("tests.test_moe_models:moe_parity_job", paths=ds_models, layout={})
    _assert_matches(results, ds_reference)


# Exported (and compared byte for byte with the loaded file) in the same run as the logits: a run
# of its own would build and load every model again.
EXPORTED = ("pp2", "ep2")


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(ep=2)], ids=["tp2", "pp2", "ep2"])
def test_deepseek_logits_match_transformers_two_processes(pool2, ds_models, ds_reference, layout, tmp_path):
    """Logits at every two-process layout; under pp=2 and ep=2 the export is byte-identical to the
    file it was loaded from, the expert biases included."""
    paths = _moe_only(ds_models, layout)
    export = "".join(f"{k}{v}" for k, v in layout.items()) in EXPORTED
    kwargs = dict(export_dir=str(tmp_path)) if export else {}
    results = pool2.run("tests.test_moe_models:moe_parity_job", paths=paths, layout=layout, **kwargs)
    assert set(results[-1]) == set(paths)
    _assert_matches(results[-1], ds_reference)
    if layout.get("pp", 1) == 1:
        _assert_matches(results[0], ds_reference)
    for name, path in paths.items() if export else ():
        original, exported = os.path.join(path, "model.safetensors"), tmp_path / name / "model.safetensors"
        assert filecmp.cmp(original, exported, shallow=False), f"{name}: export differs from {original}"


@pytest.fixture(scope="module")
def pool4():
    """Four processes: expert parallelism inside a pipeline stage (ep=2 x pp=2, dp=2)."""
    from verl_megatron.distributed.dist_pool import DistPool

    pool = DistPool(4)
    yield pool
    pool.close()


def test_deepseek_logits_match_transformers_ep2_pp2(pool4, ds_models, ds_reference, tmp_path):
    """GLM-4.5 (the same routing, grouped-query attention), GPT-OSS and Qwen3-Next ride along: one
    4-process pool checks every MoE family at ep=2 x pp=2."""
    layout = dict(ep=2, pp=2)
    builders = {"glm4_moe": build_glm4_moe, "gpt_oss": build_gpt_oss, "qwen3_next": build_qwen3_next}
    others = {name: str(tmp_path / name) for name in builders}
    for name, build in builders.items():
        build(others[name])
    reference = {**ds_reference, **hf_reference_logits(others, SEQUENCES)}
    paths = {**_moe_only(ds_models, layout), **others}
    results = pool4.run("tests.test_moe_models:moe_parity_job", paths=paths, layout=layout)
    for rank in (2, 3):  # the last pipeline stage: its two expert-parallel ranks
        assert set(results[rank]) == set(paths)
        _assert_matches(results[rank], reference)
