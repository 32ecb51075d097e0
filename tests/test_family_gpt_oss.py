"""GPT-OSS checkpoints: megatron (sinks, alternating sliding windows, biased experts with the clamped
SwiGLU, biased router, YaRN) reproduces transformers.

A tiny random GPT-OSS (``tests/family_gpt_oss.py``: a window of 4 keys on layer 0 over sequences of
5-12 tokens, a SwiGLU clamp of 1.5 that the activations cross, random sinks and biases) is loaded
by ``load_hf_weights``. float32 logits must equal transformers' to 1e-4 at tp=1, tp=2 (expert tp 1:
megatron's experts take biases only then), pp=2 and ep=2, and the export (under ep=2 and pp=2: the
stacked expert tensors rebuilt from slices held by two ranks) must be byte-identical to the file it
was loaded from. Each feature changes transformers' logits by more than 1 on this model (window
off: 5.3, window 5 instead of 4: 4.5, no clamp: 2.8, alpha 1.702: 1.3, sinks off: 3.9), so a
match at 1e-4 checks every one of them.
"""

from __future__ import annotations

import filecmp
import os

import pytest

from tests.family_gpt_oss import build_gpt_oss
from tests.helpers import hf_reference_logits
from tests.test_models_parity import SEQUENCES

JOB = "tests.test_moe_models:moe_parity_job"


@pytest.fixture(scope="module")
def oss(tmp_path_factory) -> tuple[dict[str, str], dict]:
    """The checkpoint's folder by name, and transformers' logits of the parity sequences."""
    paths = {"gpt_oss": str(tmp_path_factory.mktemp("tiny_gpt_oss") / "gpt_oss")}
    build_gpt_oss(paths["gpt_oss"])
    return paths, hf_reference_logits(paths, SEQUENCES)


def _assert_matches(results: dict, reference: dict) -> None:
    for name, expected in reference.items():
        for i, (got, want) in enumerate(zip(results[name], expected, strict=True)):
            assert want.abs().max() > 1.0  # logits of a realistic size, so atol is meaningful
            diff = (got - want).abs()
            where = divmod(int(diff.argmax()), diff.shape[1])
            assert float(diff.max()) <= 1e-4, (
                f"{name} sequence {i}: max |megatron - transformers| = {float(diff.max()):.3g} at (token, id) {where}"
            )


def test_gpt_oss_logits_match_transformers_one_process(pool1, oss):
    (results,) = pool1.run(JOB, paths=oss[0], layout={})
    _assert_matches(results, oss[1])


@pytest.mark.parametrize("layout", [dict(tp=2, etp=1), dict(pp=2), dict(ep=2)], ids=["tp2", "pp2", "ep2"])
def test_gpt_oss_logits_match_transformers_two_processes(pool2, oss, layout):
    results = pool2.run(JOB, paths=oss[0], layout=layout)
    _assert_matches(results[-1], oss[1])
    if layout.get("pp", 1) == 1:
        _assert_matches(results[0], oss[1])


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2)], ids=["ep2", "pp2"])
def test_gpt_oss_export_is_byte_identical(pool2, oss, tmp_path, layout):
    pool2.run(JOB, paths=oss[0], layout=layout, export_dir=str(tmp_path))
    original, exported = (
        os.path.join(oss[0]["gpt_oss"], "model.safetensors"),
        tmp_path / "gpt_oss" / "model.safetensors",
    )
    assert filecmp.cmp(original, exported, shallow=False), f"export under {layout} differs from {original}"


def test_gpt_oss_start_up_weight_check(oss, tmp_path):
    """The start-up check knows GPT-OSS's tensors: the checkpoint passes; one without a layer's
    sinks is refused naming that tensor."""
    from safetensors.torch import load_file, save_file

    from verl_megatron.models.checkpoint_check import HFWeightsError, check_hf_weights
    from verl_megatron.models.config import load_hf_config, read_hf_architecture

    path = oss[0]["gpt_oss"]
    arch = read_hf_architecture(load_hf_config(path))
    check_hf_weights(path, arch)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFWeightsError, match=r"model\.layers\.1\.self_attn\.sinks"):
        check_hf_weights(str(tmp_path), arch)


def test_check_hf_at_tp_2_needs_expert_tp_1_before_launching(oss, capsys, monkeypatch):
    import verl_megatron.tools.check_hf as check_hf
    from verl_megatron import cli

    path = oss[0]["gpt_oss"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(check_hf, "_launch", lambda *a: pytest.fail("torchrun launched"))
    monkeypatch.setattr(check_hf, "run_check", lambda *a: 0)
    assert cli.main(["check-hf", path, "--tp", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: check-hf {path} --tp 2 --pp 1: gpt_oss's experts"), (
        err
    )
    assert err[0].endswith("got 2 (etp unset: tp); set etp=1 (parallel.etp=1, check-hf --etp 1)"), err
    launched = []
    monkeypatch.setattr(check_hf, "_launch", lambda argv, nproc: launched.append(nproc) or 0)
    assert cli.main(["check-hf", path, "--tp", "2", "--etp", "1"]) == 0
    assert launched == [2] and capsys.readouterr().err.strip() == ""
