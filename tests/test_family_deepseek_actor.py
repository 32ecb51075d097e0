"""DeepSeek-V3 actor updates: every layout gives the one-process numbers; the expert bias moves.

The batch and actor settings of ``test_actor_update`` (compute_log_prob + update_policy, one
mini-batch of 8 rows in micro-batches of 2: one optimizer step) on tiny DeepSeek-V3 checkpoints:
an MoE one (MLA, a dense layer, a sigmoid-routed layer with expert biases) at ep=2 (with dp=2) and
pp=2, and a dense MLA one at tp=2 (megatron trains MoE layers at tp > 1 only with sequence
parallelism, a GPU feature). Log-probs, metrics and the updated weights (the expert biases
included) must match the single-process run within the float32 floor of ``test_actor_update``;
packed rows and dynamic micro-batches must match padded rows in one process.

Aux-loss-free balancing is checked against an independent count: transformers' router, run on the
batch's real tokens with the starting weights, gives each expert's load; after the step every
bias must be its starting value + 1e-3 * sign(mean load - load), as DeepSeek-V3 describes.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_models import DEEPSEEK_V3_ACTOR, build_deepseek_v3
from tests.helpers import saved_model
from tests.test_actor_update import (
    VARIANTS,
    _assert_same_update,
    build_actor,
    kl_actor_config,
    kl_update_record,
    make_batch,
    merge,
)

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
RATE = 1e-3


def ds_actor_job(path: str, layout: dict, variants: list[str]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    out = {}
    for variant in variants:
        cfg = kl_actor_config(ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=8, **VARIANTS[variant])
        chunks, actor = build_actor(runtime, path, cfg)
        out[variant] = kl_update_record(runtime, chunks, actor)
    return out


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_dsv3_moe", lambda p: build_deepseek_v3(p, **DEEPSEEK_V3_ACTOR))


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    return saved_model(
        tmp_path_factory,
        "tiny_dsv3_dense",
        lambda p: build_deepseek_v3(p, **DEEPSEEK_V3_ACTOR, first_k_dense_replace=2),
    )


@pytest.fixture(scope="module")
def moe_reference(pool1, moe_path) -> dict:
    variants = ["padded", "packed", "dynamic"]
    return merge(pool1.run(f"{__name__}:ds_actor_job", path=moe_path, layout={}, variants=variants))


def test_packed_and_dynamic_rows_match_padded(moe_reference):
    assert moe_reference["padded"]["metrics"]["actor/pg_loss"][0] != 0.0
    _assert_same_update(moe_reference["packed"], moe_reference["padded"])
    _assert_same_update(moe_reference["dynamic"], moe_reference["padded"])


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2)], ids=["ep2-dp2", "pp2"])
def test_moe_layouts_match_single_process(pool2, moe_path, moe_reference, layout):
    run = merge(pool2.run(f"{__name__}:ds_actor_job", path=moe_path, layout=layout, variants=["padded"]))
    _assert_same_update(run["padded"], moe_reference["padded"])
    assert torch.equal(run["padded"]["weights"][BIAS], moe_reference["padded"]["weights"][BIAS])


def test_dense_mla_tp2_matches_single_process(pool1, pool2, dense_path):
    ref = merge(pool1.run(f"{__name__}:ds_actor_job", path=dense_path, layout={}, variants=["padded"]))
    run = merge(
        pool2.run(f"{__name__}:ds_actor_job", path=dense_path, layout=dict(tp=2), variants=["padded"])
    )
    _assert_same_update(run["padded"], ref["padded"])


def _hf_expert_load(path: str) -> torch.Tensor:
    """Tokens per expert [E] of layer 1 over the batch's real tokens, by transformers' router."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    chosen = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
    with torch.no_grad():
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
    hook.remove()
    real = batch["attention_mask"].reshape(-1).bool()
    return torch.bincount(chosen[0][real].reshape(-1), minlength=model.config.n_routed_experts).float()


def test_expert_bias_update_follows_the_load(moe_path, moe_reference):
    from safetensors import safe_open

    with safe_open(f"{moe_path}/model.safetensors", "pt") as f:
        start = f.get_tensor(BIAS)
    load = _hf_expert_load(moe_path)
    assert load.sum() == 4 * make_batch()["attention_mask"].sum()  # top-4 of every real token
    assert load.min() != load.max()  # an unbalanced load, so the update is not all zero
    expected = start + RATE * torch.sign(load.mean() - load)
    for variant in ("padded", "packed", "dynamic"):
        got = moe_reference[variant]["weights"][BIAS]
        diff = float((got - expected).abs().max())
        assert diff < 1e-7, (
            f"{variant}: expert bias off the expected update by {diff:.3g}: {got} vs {expected}"
        )
