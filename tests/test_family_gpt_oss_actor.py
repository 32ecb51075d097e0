"""GPT-OSS actor updates: every layout gives the one-process numbers, and the log-probs are transformers'.

The batch and actor settings of ``test_actor_update`` (compute_log_prob + update_policy, one
mini-batch of 8 left-padded rows of up to 11 tokens in micro-batches of 2: one optimizer step) on
a tiny GPT-OSS (``tests/family_gpt_oss.py`` at vocabulary 63: a window of 4 keys on layer 0,
sinks, biased experts and router, the clamped SwiGLU, YaRN). The padded rows' log-probs and
entropies must be transformers' (1e-5 + 2e-5); packed rows and dynamic micro-batches must match
padded rows in one process; ep=2 (dp=2) and pp=2 must match the single-process run within the
float32 floor of ``test_actor_update`` (megatron trains MoE layers at tp > 1 only with sequence
parallelism, a GPU feature).
"""

from __future__ import annotations

import pytest

from tests.family_gpt_oss import build_gpt_oss
from tests.helpers import saved_model
from tests.test_actor_update import TP_LEN, VOCAB, _assert_same_update, _hf_log_probs, make_batch, merge

# (path, layout, variants) -> per-variant log-probs, metrics and weights after one step.
JOB = "tests.test_family_deepseek_actor:ds_actor_job"


@pytest.fixture(scope="module")
def oss_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_gpt_oss_actor", lambda p: build_gpt_oss(p, vocab_size=VOCAB))


@pytest.fixture(scope="module")
def oss_reference(pool1, oss_path) -> dict:
    variants = ["padded", "packed", "dynamic"]
    return merge(pool1.run(JOB, path=oss_path, layout={}, variants=variants))


def test_gpt_oss_one_process_matches_transformers_and_packing(oss_reference, oss_path):
    """Padded rows' log-probs / entropies are transformers'; packed and dynamic rows update alike."""
    hf_lp, hf_ent = _hf_log_probs(oss_path)
    valid = make_batch()["attention_mask"][:, TP_LEN:].bool()
    padded = oss_reference["padded"]
    for what, got, want in (
        ("log-probs", padded["old_log_probs"], hf_lp),
        ("entropy", padded["entropy"], hf_ent),
    ):
        diff = (got[valid] - want[valid]).abs()
        assert float(diff.max()) <= 2e-5 + 1e-5 * float(want[valid].abs().max()), (
            f"{what}: max |megatron - transformers| = {float(diff.max()):.3g} at valid token {int(diff.argmax())}"
        )
    assert padded["metrics"]["actor/pg_loss"][0] != 0.0
    for variant in ("packed", "dynamic"):
        _assert_same_update(oss_reference[variant], padded)


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2)], ids=["ep2-dp2", "pp2"])
def test_gpt_oss_layouts_match_single_process(pool2, oss_path, oss_reference, layout):
    from safetensors import safe_open

    run = merge(pool2.run(JOB, path=oss_path, layout=layout, variants=["padded"]))
    _assert_same_update(run["padded"], oss_reference["padded"])
    with safe_open(f"{oss_path}/model.safetensors", "pt") as f:  # the sinks are trained
        for name in ("model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"):
            moved = float((run["padded"]["weights"][name] - f.get_tensor(name)).abs().min())
            assert moved > 0, f"{name}: a sink did not move in the update"
