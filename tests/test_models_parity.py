"""Megatron built from a Hugging Face checkpoint reproduces transformers' logits under tp and pp.

Tiny random checkpoints of every supported family (GQA and MHA, tied and untied embeddings,
q/k/v and all-linear biases, QK-norm, Llama 3 rope scaling, a vocabulary that tp=2 must pad)
are loaded into megatron by ``load_hf_weights`` under tp=1, tp=2 and pp=2; their float32
logits must equal transformers' to 1e-4 (logits are O(1): weights use initializer_range 0.2).
Also covers ``verl-megatron check-hf`` (launching itself under torchrun, and its failure status).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import hf_reference_logits, save_tiny_models
from tests.inprocess_launch import run_cli, warm_ranks

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
    "high_freq_factor": 2.0, "original_max_position_embeddings": 64,
}  # fmt: skip

# name -> build_tiny_hf_model arguments (hidden 64, 4 heads, ffn 128 unless overridden)
CASES: dict[str, dict] = {
    "llama_gqa_llama3rope": dict(family="llama", num_kv_heads=2, vocab_size=131, rope_parameters=LLAMA3_ROPE),
    "llama_mha_tied_biases": dict(
        family="llama", num_kv_heads=4, vocab_size=128, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True,
    ),
    "qwen2_tied": dict(family="qwen2", num_kv_heads=2, vocab_size=131, tie_word_embeddings=True),
    "qwen3_headdim32": dict(family="qwen3", num_kv_heads=2, vocab_size=131, num_layers=4, head_dim=32),
    "mistral_gqa": dict(family="mistral", num_kv_heads=2, vocab_size=130, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}),
}  # fmt: skip
SEQUENCES = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 12)]


def make_tiny_model(out_dir: str, spec: dict, seed: int = 0):
    """Save a tiny HF model whose biases and norm weights are random too (HF starts them at 0/1,
    which would hide a swapped q/k norm or a misplaced bias); returns the model."""
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    spec = dict(spec)
    family = spec.pop("family")
    model = build_tiny_hf_model(out_dir, family, seed=seed, initializer_range=0.2, **spec)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return save_tiny_models(tmp_path_factory.mktemp("tiny_hf"), CASES, make_tiny_model)


@pytest.fixture(scope="module")
def hf_reference(tiny_models) -> dict[str, list[torch.Tensor]]:
    return hf_reference_logits(tiny_models, SEQUENCES)


def parity_job(paths: dict[str, str], tp: int, pp: int, sequences: list[torch.Tensor]) -> dict:
    """On every rank: build + load each checkpoint, return its logits (None off the last stage)
    and, with tp > 1, the padded logit columns of one gathered forward."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks, model_info
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.tools.check_hf import megatron_logits

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp))
    out = {}
    for name, path in paths.items():
        chunks = build_gpt_chunks(load_hf_config(path), runtime, ModelConfig(path=path, dtype="float32"))
        load_hf_weights(chunks, path, runtime)
        info = model_info(chunks)
        result = {
            "logits": megatron_logits(chunks, runtime, sequences),
            "padded_vocab": info.padded_vocab_size,
        }
        if pp == 1:
            ids = sequences[0].unsqueeze(0)
            with torch.no_grad():
                full = chunks[0](ids, torch.arange(ids.shape[1])[None], None, runtime_gather_output=True)
            result["padded_columns"] = full[..., info.vocab_size :]
        out[name] = result
    return out


def _assert_matches(results: dict, reference: dict) -> None:
    for name, expected in reference.items():
        for got, want in zip(results[name]["logits"], expected, strict=True):
            assert want.abs().max() > 1.0  # logits of a realistic size, so atol is meaningful
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_logits_match_transformers_tp1(pool1, tiny_models, hf_reference):
    (results,) = pool1.run(f"{__name__}:parity_job", paths=tiny_models, tp=1, pp=1, sequences=SEQUENCES)
    _assert_matches(results, hf_reference)
    assert results["qwen2_tied"]["padded_vocab"] == 256  # 131 padded to a multiple of 128


def test_logits_match_transformers_tp2_with_padded_vocab(pool2, tiny_models, hf_reference):
    rank0, rank1 = pool2.run(f"{__name__}:parity_job", paths=tiny_models, tp=2, pp=1, sequences=SEQUENCES)
    _assert_matches(rank0, hf_reference)
    for name in tiny_models:
        for a, b in zip(rank0[name]["logits"], rank1[name]["logits"]):
            assert torch.equal(a, b)
    # Vocabularies are padded to a multiple of 128 (the same at tp=1 and 2); the converter zeroes
    # the padded rows, so their logits are exactly 0.
    assert {n: r["padded_vocab"] for n, r in rank0.items()} == {
        "llama_gqa_llama3rope": 256, "llama_mha_tied_biases": 128, "qwen2_tied": 256,
        "qwen3_headdim32": 256, "mistral_gqa": 256,
    }  # fmt: skip
    for name in ("llama_gqa_llama3rope", "qwen2_tied", "qwen3_headdim32"):
        padded = rank0[name]["padded_columns"]
        assert padded.shape[-1] == 125 and torch.count_nonzero(padded) == 0


def test_logits_match_transformers_pp2(pool2, tiny_models, hf_reference):
    first, last = pool2.run(f"{__name__}:parity_job", paths=tiny_models, tp=1, pp=2, sequences=SEQUENCES)
    assert all(r["logits"] is None for r in first.values())
    _assert_matches(last, hf_reference)


def check_hf_job(path: str) -> tuple[int, int]:
    """check-hf's exit status inside an existing process group: float32 default, and bf16 with
    a zero tolerance (bf16 cannot reproduce float32 logits exactly)."""
    from verl_megatron.tools.check_hf import main

    return main([path]), main([path, "--dtype", "bfloat16", "--tolerance", "0"])


def test_check_hf_status(pool1, tiny_models):
    (statuses,) = pool1.run(f"{__name__}:check_hf_job", path=tiny_models["qwen3_headdim32"])
    assert statuses == (0, 1)


def nan_check_hf_job(path: str) -> int:
    """check-hf's status when one logit of megatron's second prompt is NaN (its first prompt is exact)."""
    import verl_megatron.tools.check_hf as check_hf

    original = check_hf.megatron_logits

    def with_nan(*args, **kwargs):
        logits = original(*args, **kwargs)
        logits[1][3, 5] = float("nan")
        return logits

    check_hf.megatron_logits = with_nan  # this worker process only, restored below
    try:
        return check_hf.main([path])
    finally:
        check_hf.megatron_logits = original


def test_check_hf_fails_on_a_nan_logit(pool1, tiny_models):
    (status,) = pool1.run(f"{__name__}:nan_check_hf_job", path=tiny_models["qwen3_headdim32"])
    assert status == 1


def test_check_hf_command_launches_tp_times_pp_processes(tiny_models, tmp_path, monkeypatch, capfd):
    """``verl-megatron check-hf DIR --tp 2`` outside torchrun starts torch's launcher with 2 ranks.
    The command runs in this process and the ranks are forked from a warm process: the launch is
    the subject, not how an interpreter imports torch (each fresh one costs ~6 CPU s)."""
    with warm_ranks(str(tmp_path)) as env:
        proc = run_cli(["check-hf", tiny_models["qwen2_tied"], "--tp", "2"], monkeypatch, capfd, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"tp=2 pp=1 .*max \|logit diff\| = (\S+) over 3 prompts .*: OK", proc.stdout)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) < 1e-4
