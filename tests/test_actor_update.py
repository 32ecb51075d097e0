"""MegatronActor: log-probs and one PPO update give the same numbers under every layout.

A tiny Llama (vocabulary 63, padded to 64 under tp=2) is loaded from a local Hugging
Face checkpoint. Each job runs, per variant (padded rows, packed rows, dynamic
micro-batches, ...), compute_log_prob followed by update_policy on the same global
batch of left-padded prompts and right-padded responses (two mini-batches, so two
optimizer steps). The single-process padded run is the reference: log-probs,
metrics and updated weights of tp=2, pp=2 and dp=2 and of the other variants must
match it. The reference itself is checked against transformers' forward pass and
hand-computed values (first-step ppo_kl and clipfrac exactly 0, the k3 KL loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report

VOCAB, TP_LEN, TR_LEN, BATCH = 63, 6, 5, 8
TEMPERATURE, KL_SHIFT, LR = 0.8, 0.3, 1e-2


def build_hf_model(path: str) -> None:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(
        path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=11,
    )  # fmt: skip


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts [B, 6], right-padded responses [B, 5]; one row has no response,
    one has an environment token (attention 1, response_mask 0)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.tensor([6, 3, 1, 4, 5, 2, 6, 3])
    resp_lens = torch.tensor([5, 2, 4, 0, 3, 5, 1, 4])
    prompts = torch.randint(1, VOCAB, (BATCH, TP_LEN), generator=g)
    responses = torch.randint(1, VOCAB, (BATCH, TR_LEN), generator=g)
    batch = padded_batch(prompts, responses, prompt_lens, resp_lens)
    batch["response_mask"][5, 2] = 0.0  # a tool/environment token: attended to, not trained on
    batch["advantages"] = torch.randn(BATCH, TR_LEN, generator=g) * batch["response_mask"]
    return batch


def padded_batch(
    prompts: torch.Tensor, responses: torch.Tensor, prompt_lens: torch.Tensor, resp_lens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Prompts left-padded and responses right-padded to the given lengths (zeros elsewhere)."""
    tp, tr = prompts.shape[1], responses.shape[1]
    prompt_mask = torch.arange(tp)[None, :] >= tp - prompt_lens[:, None]
    resp_mask = torch.arange(tr)[None, :] < resp_lens[:, None]
    prompts = torch.where(prompt_mask, prompts, torch.zeros_like(prompts))
    responses = torch.where(resp_mask, responses, torch.zeros_like(responses))
    attention = torch.cat([prompt_mask, resp_mask], dim=1).long()
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "response_mask": resp_mask.float(),
    }


def build_model(runtime, path: str, *, value_head: bool = False, ddp: bool = True, route=None, **model):
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.megatron_model import wrap_ddp

    model_cfg = ModelConfig(path=path, dtype="float32", use_te=False, **model)
    chunks = build_gpt_chunks(load_hf_config(path), runtime, model_cfg, value_head=value_head, route=route)
    load_hf_weights(chunks, path, runtime, model_cfg)
    return wrap_ddp(chunks) if ddp else chunks


def full_weights(chunks, runtime) -> dict[str, torch.Tensor]:
    """Whole weights under Hugging Face names (layout-independent), on global rank 0 only."""
    from verl_megatron.models.convert import iter_hf_weights

    weights = {name: tensor.cpu() for name, tensor in iter_hf_weights(chunks, runtime)}
    return weights if runtime.rank == 0 else {}


VARIANTS = {
    "padded": {"use_remove_padding": False},
    "packed": {"use_remove_padding": True},
    "dynamic": {"use_remove_padding": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16},
    "seqmean": {"loss_agg_mode": "seq-mean-token-mean", "shuffle": True, "ppo_epochs": 2},
    "nan": {},
    # The first mini-batch's old log-probs from its update forward; the others arrive only when the
    # update cuts its second mini-batch (an async run's rollout rows, workers/batching.LateRows).
    "late": {"use_remove_padding": True, "old_log_probs_from_first_update": True},
}


def kl_actor_config(**settings):
    """The actor settings the update tests share: mini-batches of 4 rows, entropy bonus 0.01, the
    k3 ("low_var_kl") KL loss at 0.1, Adam at LR without weight decay, clipping at 1.0; ``settings``
    on top."""
    from verl_megatron.workers.config import ActorConfig, OptimConfig

    shared = {
        "ppo_mini_batch_size": 4,
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "kl_loss_type": "low_var_kl",
        "optim": OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0),
    }
    return ActorConfig(**{**shared, **settings})


def actor_config(variant: str):
    return kl_actor_config(ppo_micro_batch_size_per_gpu=2, **VARIANTS[variant])


def build_actor(runtime, path: str, cfg, **model) -> tuple[list, Any]:
    """(chunks, MegatronActor) on the checkpoint at ``path``, with its optimizer and LR schedule;
    built as the trainer builds it, with a ``MatmulRoute`` its updates turn on."""
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    route = MatmulRoute()
    chunks = build_model(runtime, path, route=route, **model)
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    scheduler = build_lr_scheduler(optimizer, cfg.optim)
    return chunks, MegatronActor(runtime, cfg, chunks, optimizer, scheduler, route=route)


def kl_update(actor, spoil: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """make_batch()'s log-probs and entropies [B, Tr] at TEMPERATURE, then update_policy with the
    reference log-probs KL_SHIFT below them (``spoil(data)`` first, where given): metrics."""
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.batching import LateRows

    data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
    old_log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    data.batch["old_log_probs"] = old_log_probs
    data.batch["ref_log_prob"] = old_log_probs - KL_SHIFT * data.batch["response_mask"]
    if spoil is not None:
        spoil(data)
    late = None
    if actor.config.old_log_probs_from_first_update:  # none given: rows 0..3 its own, 4.. arrive late
        first = actor.config.ppo_mini_batch_size
        data.batch["old_log_probs"] = torch.full_like(old_log_probs, float("nan"))
        late = LateRows(first, lambda: {"old_log_probs": old_log_probs[first:]})
    return old_log_probs, entropy, actor.update_policy(data, late)


def kl_update_record(runtime, chunks, actor, spoil: Callable | None = None) -> dict:
    """:func:`kl_update`'s log-probs, entropies and metrics, and the updated weights."""
    old_log_probs, entropy, metrics = kl_update(actor, spoil)
    return {
        "old_log_probs": old_log_probs,
        "entropy": entropy,
        "metrics": metrics,
        "weights": full_weights(chunks, runtime),
    }


def _nan_advantage(data) -> None:
    data.batch["advantages"][0, 1] = float("nan")  # in the first mini-batch only


def actor_job(path: str, tp: int, pp: int, variants: list[str]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    out = {}
    for variant in variants:
        chunks, actor = build_actor(runtime, path, actor_config(variant))
        out[variant] = kl_update_record(runtime, chunks, actor, _nan_advantage if variant == "nan" else None)
    return out


def ref_job(path: str, tp: int, pp: int, rows: int) -> dict:
    """MegatronRef on frozen, unwrapped chunks: log-probs of the first ``rows`` rows, with
    token-budget micro-batches requested through meta_info (verl's keys)."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.actor import MegatronRef
    from verl_megatron.workers.config import RefConfig

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    ref = MegatronRef(
        runtime, RefConfig(log_prob_micro_batch_size_per_gpu=3), build_model(runtime, path, ddp=False)
    )
    batch = {k: v[:rows] for k, v in make_batch().items()}
    meta = {"temperature": TEMPERATURE, "use_dynamic_bsz": True, "max_token_len": 20}
    log_probs, entropy = ref.compute_log_prob(DataProto.from_dict(batch, meta_info=meta))
    frozen = all(not p.requires_grad for c in ref.chunks for p in c.parameters())
    return {"log_probs": log_probs, "entropy": entropy, "frozen": frozen}


def merge(results: list[dict]) -> dict:
    merged = {}
    for variant, first in results[0].items():
        weights = {}
        for r in results:
            weights.update(r[variant]["weights"])
        merged[variant] = {**first, "weights": weights}
    return merged


@pytest.fixture(scope="module")
def reference(pool1, model_path) -> dict:
    return merge(pool1.run(f"{__name__}:actor_job", path=model_path, tp=1, pp=1, variants=list(VARIANTS)))


def _hf_log_probs(path: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-probs and entropies of the response tokens at TEMPERATURE, [B, Tr], in
    ``dtype`` (float64 gives the exact reference)."""
    from transformers import AutoModelForCausalLM

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    logits = logits[:, TP_LEN - 1 : -1] / TEMPERATURE
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    probs = torch.softmax(logits, -1)
    entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    return log_probs, entropy


def test_log_probs_match_transformers(reference, model_path):
    hf_lp, hf_ent = _hf_log_probs(model_path)
    valid = make_batch()["attention_mask"][:, TP_LEN:].bool()
    for variant in ("padded", "packed"):
        run = reference[variant]
        torch.testing.assert_close(run["old_log_probs"][valid], hf_lp[valid], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(run["entropy"][valid], hf_ent[valid], rtol=1e-5, atol=2e-5)
        assert torch.all(run["old_log_probs"][~valid] == 0)


def test_first_step_is_on_policy_and_kl_is_hand_checked(reference):
    metrics = reference["padded"]["metrics"]
    # Unchanged weights: the ratio is exactly 1, so nothing is clipped and ppo_kl is 0.
    assert metrics["actor/ppo_kl"][0] == 0.0
    assert metrics["actor/pg_clipfrac"][0] == 0.0
    assert metrics["actor/pg_clipfrac_lower"][0] == 0.0
    # ref = old - 0.3 on trained tokens: k3 = exp(-0.3) + 0.3 - 1 on every one of them.
    assert math.isclose(metrics["actor/kl_loss"][0], math.exp(-KL_SHIFT) + KL_SHIFT - 1, rel_tol=1e-5)
    # The entropy metric is the token mean over the first mini-batch (rows 0-3).
    mask = make_batch()["response_mask"][:4]
    expected = float((reference["padded"]["entropy"][:4] * mask).sum() / mask.sum())
    assert math.isclose(metrics["actor/entropy"][0], expected, rel_tol=1e-5)
    # The second mini-batch sees weights moved by the first step.
    assert metrics["actor/ppo_kl"][1] != 0.0
    assert len(metrics["actor/grad_norm"]) == 2 and metrics["actor/skipped_steps"] == 0.0
    assert metrics["actor/lr"] == LR


def test_non_finite_gradient_skips_the_step(reference):
    metrics = reference["nan"]["metrics"]
    assert metrics["actor/skipped_steps"] == 1.0
    assert math.isnan(metrics["actor/grad_norm"][0]) and math.isfinite(metrics["actor/grad_norm"][1])
    # The skipped step left the weights alone, so mini-batch 2 is still exactly on-policy.
    assert metrics["actor/ppo_kl"][1] == 0.0
    weights = reference["nan"]["weights"]
    assert all(torch.isfinite(w).all() for w in weights.values())
    moved = (
        weights["model.layers.0.mlp.up_proj.weight"]
        - reference["padded"]["weights"]["model.layers.0.mlp.up_proj.weight"]
    )
    assert moved.abs().max() > 0


def test_reference_policy_with_odd_batch_over_dp2(pool2, reference, model_path):
    # 7 rows over dp=2: the second rank's share wraps around and the padding is dropped.
    results = pool2.run(f"{__name__}:ref_job", path=model_path, tp=1, pp=1, rows=7)
    for r in results:
        assert r["frozen"] and r["entropy"] is None
        torch.testing.assert_close(
            r["log_probs"], reference["padded"]["old_log_probs"][:7], rtol=1e-5, atol=1e-5
        )


def test_missing_temperature_or_keys_raise():
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.actor import batch_tensors, temperature_of

    data = DataProto.from_dict(make_batch())
    with pytest.raises(KeyError, match="temperature"):
        temperature_of(data, "where")
    with pytest.raises(KeyError, match=r"missing \['old_log_probs'\]"):
        batch_tensors(data, ("input_ids", "attention_mask", "responses", "old_log_probs"), "where")
    data.batch["advantages"] = torch.zeros(BATCH, TR_LEN + 1)
    with pytest.raises(ValueError, match="'advantages' has shape"):
        batch_tensors(data, ("input_ids", "attention_mask", "responses", "advantages"), "where")


def _assert_same_update(run: dict, ref: dict) -> None:
    assert_close_report(
        run["old_log_probs"], ref["old_log_probs"], rtol=1e-5, atol=1e-5, what="old_log_probs"
    )
    assert_close_report(run["metrics"], ref["metrics"], rtol=1e-4, atol=1e-6, what="metrics")
    steps = len(ref["metrics"]["actor/grad_norm"])
    assert_adam_weights_close(run["weights"], ref["weights"], lr=LR, steps=steps, what="weights")


def test_variants_match_padded_reference(reference):
    start = reference["padded"]["weights"]["model.layers.1.self_attn.q_proj.weight"]
    assert (
        reference["seqmean"]["metrics"]["actor/pg_loss"][0]
        != reference["padded"]["metrics"]["actor/pg_loss"][0]
    )
    assert len(reference["seqmean"]["metrics"]["actor/pg_loss"]) == 4  # 2 epochs x 2 mini-batches
    assert start.abs().max() > 0
    _assert_same_update(reference["packed"], reference["padded"])
    _assert_same_update(reference["dynamic"], reference["padded"])
    _assert_same_update(reference["late"], reference["packed"])  # late rows: the same update


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_layouts_match_single_process(pool2, reference, model_path, tp, pp):
    variants = ["padded", "packed", "dynamic", "seqmean", "late"]
    run = merge(pool2.run(f"{__name__}:actor_job", path=model_path, tp=tp, pp=pp, variants=variants))
    for variant in variants:
        _assert_same_update(run[variant], reference[variant])
