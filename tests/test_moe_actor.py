"""MoE actor updates: expert parallelism gives the one-process numbers; the aux loss is scaled right.

A tiny Qwen3-MoE (4 experts, top-2, two MoE layers, aux loss on with coefficient 0.1) runs
compute_log_prob + update_policy (two mini-batches of two micro-batches, so two optimizer
steps) on the batch of ``test_actor_update``. The single-process run is the reference: ep=2
(with dp=2) and pp=2 (uniform padded micro-batches, whose filler the routers must ignore) must
reproduce its log-probs, metrics (the MoE ones included) and updated weights, within the
float32 noise floor of ``test_actor_update``. (Training with tp > 1 needs sequence parallelism
in megatron's MoE layer, hence Transformer Engine: not on CPU; ep x tp forwards are covered
by ``test_moe_models``.)

The aux-loss gradient is checked against an independent reference: with a zero policy loss
over three micro-batches (3, 3 and 2 rows), the gradient of every weight must equal that of
``coef / top_k * mean over micro-batches of sum over layers of transformers'
load_balancing_loss_func(layer logits, attention mask)`` computed through the HF model
(megatron's per-layer switch loss is transformers' divided by top-k).

Interleaved pp=2 x vpp=2 with one micro-batch per step runs a padding repeat of it: the MoE
metrics, the routers' expert-bias counts and megatron's aux-loss sums must hold the real
micro-batch once, as one process does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.closeness import assert_close_report
from tests.family_models import build_glm4_moe
from tests.helpers import saved_model
from tests.test_actor_update import (
    TEMPERATURE,
    _assert_same_update,
    actor_config,
    build_actor,
    build_model,
    full_weights,
    make_batch,
    merge,
)

VOCAB, AUX_COEF, TOPK, EXPERTS, LAYERS = 63, 0.1, 2, 4, 4


def build_moe_model(path: str) -> None:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(
        path, "qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=11, output_router_logits=True, router_aux_loss_coef=AUX_COEF,
        num_experts=EXPERTS, num_experts_per_tok=TOPK, initializer_range=0.1,
    )  # fmt: skip


def moe_actor_job(
    path: str,
    layout: dict,
    foreign_losses: bool = False,
    micro_batch_size: int = 2,
    model: dict | None = None,
) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    cfg = dataclasses.replace(actor_config("padded"), ppo_micro_batch_size_per_gpu=micro_batch_size)
    chunks, actor = build_actor(runtime, path, cfg, **(model or {}))
    # share_prompt_prefix is on by default; routing (replay, token counts) keeps every row's prompt
    assert cfg.share_prompt_prefix and actor.runner.prefix_sharing is None
    data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
    old_log_probs, _ = actor.compute_log_prob(data)
    data.batch["old_log_probs"] = old_log_probs
    data.batch["ref_log_prob"] = old_log_probs - 0.3 * data.batch["response_mask"]
    if foreign_losses:  # another MoE model (a critic) trained in this process since the last collect
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        for layer in range(1, LAYERS + 1):
            save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(100.0), layer, LAYERS)
    metrics = actor.update_policy(data)
    return {
        "moe": {"old_log_probs": old_log_probs, "metrics": metrics, "weights": full_weights(chunks, runtime)}
    }


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen3_moe", build_moe_model)


@pytest.fixture(scope="module")
def moe_reference(pool1, moe_path) -> dict:
    return merge(pool1.run(f"{__name__}:moe_actor_job", path=moe_path, layout={}))["moe"]


def test_moe_metrics_are_logged(moe_reference):
    metrics = moe_reference["metrics"]
    valid_tokens = int(make_batch()["attention_mask"].sum())
    for layer in range(LAYERS):
        mean = metrics[f"actor/moe/tokens_per_expert_mean/layer_{layer}"]
        # Every real token of the batch (padding excluded) goes to top-k experts, once per step.
        assert mean * EXPERTS == valid_tokens * TOPK
        assert metrics[f"actor/moe/tokens_per_expert_max/layer_{layer}"] >= mean
        # The switch loss is E * sum_e f_e P_e: at least 1 (balanced), at most E.
        assert 1.0 <= metrics[f"actor/moe/load_balancing_loss/layer_{layer}"] <= EXPERTS
    assert metrics["actor/moe/load_imbalance"] >= 1.0
    expected = AUX_COEF * sum(metrics[f"actor/moe/load_balancing_loss/layer_{i}"] for i in range(LAYERS))
    assert metrics["actor/moe/aux_loss"] == pytest.approx(expected, rel=1e-12)


def test_another_models_aux_losses_stay_out_of_the_actors_metrics(pool1, moe_reference, moe_path):
    """megatron's aux-loss tracker is process-wide: an MoE critic's update (between two actor
    updates) added its router losses to the actor's (load_balancing_loss 1.118 -> 2.219)."""
    run = pool1.run(f"{__name__}:moe_actor_job", path=moe_path, layout={}, foreign_losses=True)[0]["moe"]
    for key, value in moe_reference["metrics"].items():
        if "/moe/" in key:
            assert run["metrics"][key] == value, (key, run["metrics"][key], value)


@pytest.mark.parametrize("layout", [dict(ep=2), dict(pp=2)], ids=["ep2-dp2", "pp2"])
def test_moe_layouts_match_single_process(pool2, moe_reference, moe_path, layout):
    run = merge(pool2.run(f"{__name__}:moe_actor_job", path=moe_path, layout=layout))["moe"]
    _assert_same_update(run, moe_reference)


@pytest.fixture(scope="module")
def one_micro_batch_reference(pool1, moe_path) -> dict:
    """One process, one micro-batch (4 rows) per optimizer step."""
    return merge(pool1.run(f"{__name__}:moe_actor_job", path=moe_path, layout={}, micro_batch_size=4))["moe"]


@pytest.mark.parametrize("model", [{}, dict(enable_gradient_checkpointing=True)], ids=["plain", "recompute"])
def test_moe_metrics_leave_out_vpp_padding_micro_batches(pool2, one_micro_batch_reference, moe_path, model):
    """One micro-batch per optimizer step: the interleaved pp=2 x vpp=2 schedule runs it twice
    (the second a padding repeat with no loss), so the routers see every token twice. The MoE
    metrics must count the real tokens once, as one process does (tokens_per_expert_mean was
    54 per layer, not 27). With recomputation the counting routers run in the backward."""
    layout = dict(pp=2, vpp=2)
    run = pool2.run(
        f"{__name__}:moe_actor_job", path=moe_path, layout=layout, micro_batch_size=4, model=model
    )
    actual = {k: v for k, v in merge(run)["moe"]["metrics"].items() if "/moe/" in k}
    expected = {k: v for k, v in one_micro_batch_reference["metrics"].items() if "/moe/" in k}
    valid_tokens = int(make_batch()["attention_mask"].sum())
    assert expected["actor/moe/tokens_per_expert_mean/layer_0"] * EXPERTS == valid_tokens * TOPK
    # Token counts are integers summed in float64 (exact); the aux losses are the same float32
    # per-micro-batch values averaged in float64: a few float64 ulps cover both.
    eps = torch.finfo(torch.float64).eps
    assert_close_report(actual, expected, rtol=8 * eps, atol=0.0, what="moe metrics")


def padding_trace_job(path: str, layout: dict) -> dict:
    """Per global MoE layer, what a training pass over one micro-batch (4 rows) leaves in the
    router's expert-bias counts and in megatron's aux-loss tracker (the aux loss switched on);
    no optimizer step consumes them here."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router import Router

    from verl_megatron.distributed.modules import unwrap
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.workers.model_runner import ModelRunner, StepResult

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    aux = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_COEF)
    chunks = build_model(runtime, path, override_transformer_config=aux)
    runner = ModelRunner(runtime, chunks, use_remove_padding=False)
    keys = ("input_ids", "attention_mask", "responses")
    batch = {k: v[:4] for k, v in make_batch().items() if k in keys}
    mbs = runner.split(batch, micro_batch_size=4, use_dynamic_bsz=False, max_token_len=0)
    runner.run(mbs, lambda mb, logits: StepResult(loss=(logits * 0).sum()), forward_only=False)
    losses = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    routers = [m for chunk in chunks for m in unwrap(chunk).modules() if isinstance(m, Router)]
    out = {
        f"expert_bias_counts/layer_{r.layer_number - 1}": r.local_tokens_per_expert.double() for r in routers
    }
    out.update(
        {f"aux_loss_sum/layer_{r.layer_number - 1}": losses[r.layer_number - 1].double() for r in routers}
    )
    return out


def test_padding_repeats_leave_no_trace_in_router_counts(pool1, pool2, tmp_path_factory):
    """Besides the metrics, the routers' expert-bias counts (the bias update's input) and the
    aux-loss tracker's sums must hold one pass over the real micro-batch under pp=2 x vpp=2,
    as in one process (both held two passes: at pp=2 a doubling leaves the bias update's signs
    alone, but with more stages the repeats are of the last micro-batch only). A GLM-4.5 (sigmoid
    routing with expert biases) of 4 layers, the last 3 mixtures of experts."""
    path = saved_model(
        tmp_path_factory, "tiny_glm4_moe_4", lambda p: build_glm4_moe(p, num_hidden_layers=LAYERS)
    )
    expected = pool1.run(f"{__name__}:padding_trace_job", path=path, layout={})[0]
    results = pool2.run(f"{__name__}:padding_trace_job", path=path, layout=dict(pp=2, vpp=2))
    actual = {k: v for r in results for k, v in r.items()}
    assert len(expected) == 2 * (LAYERS - 1) and float(expected["expert_bias_counts/layer_1"].sum()) > 0
    # Counts are integers; each tracker sum is one float32 loss, computed alike in both layouts.
    eps = torch.finfo(torch.float64).eps
    assert_close_report(actual, expected, rtol=8 * eps, atol=0.0, what="router counts")


def aux_grad_job(path: str, layout: dict) -> dict:
    """Gradients (HF names, this rank's stage) of a zero policy loss over micro-batches of 3, 3
    and 2 rows: the aux loss alone; plus the rows of each micro-batch."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import model_info
    from verl_megatron.models.convert import hf_mapping, to_hf
    from verl_megatron.models.megatron_model import attach_schedule_hooks
    from verl_megatron.models.sharding import gather_full_state
    from verl_megatron.workers.model_runner import ModelRunner, StepResult

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    chunks = build_model(runtime, path)
    attach_schedule_hooks(chunks)
    runner = ModelRunner(runtime, chunks, use_remove_padding=False)
    batch = {k: v for k, v in make_batch().items() if k in ("input_ids", "attention_mask", "responses")}
    mbs = runner.split(batch, micro_batch_size=3, use_dynamic_bsz=False, max_token_len=0)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    runner.run(mbs, lambda mb, logits: StepResult(loss=(logits * 0).sum()), forward_only=False)
    info = model_info(chunks)
    grads = {}
    for name, grad in gather_full_state(chunks, grads=True).items():
        mapping = hf_mapping(name, info)
        grads.update(zip(mapping.hf_names, to_hf(mapping, grad, info, 1)))
    return {"grads": grads, "rows": [mb.rows.tolist() for mb in mbs]}


def _hf_aux_grads(path: str, rows: list[list[int]]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    batch = make_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model.train()
    total = torch.zeros(())
    for mb_rows in rows:
        mask = batch["attention_mask"][mb_rows]
        out = model(
            input_ids=batch["input_ids"][mb_rows],
            attention_mask=mask,
            position_ids=batch["position_ids"][mb_rows],
            output_router_logits=True,
        )
        per_layer = [load_balancing_loss_func((logits,), EXPERTS, TOPK, mask) for logits in out.router_logits]
        total = total + AUX_COEF / TOPK * sum(per_layer) / len(rows)
    total.backward()
    grads = {
        name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()
    }
    for name in [n for n in grads if n.endswith("mlp.experts.gate_up_proj")]:
        # transformers holds the experts fused in memory: [E, 2F, H] ([gate; up]) and [E, H, F].
        prefix = name.removesuffix("gate_up_proj")
        gate_up, down = grads.pop(name), grads.pop(prefix + "down_proj")
        for e in range(EXPERTS):
            gate, up = gate_up[e].chunk(2)
            grads.update({f"{prefix}{e}.gate_proj.weight": gate, f"{prefix}{e}.up_proj.weight": up})
            grads[f"{prefix}{e}.down_proj.weight"] = down[e]
    return grads


@pytest.mark.parametrize("layout", [{}, dict(pp=2, vpp=2)], ids=["one-process", "pp2-vpp2"])
def test_aux_loss_gradient_matches_hand_computed_reference(pool1, pool2, moe_path, layout):
    # Interleaved pp=2 x vpp=2 runs 3 micro-batches as 4 (one padding repeat): the aux loss must
    # still be the mean over the 3 real ones (megatron's own factor would be 1/4, 4 times).
    pool = pool2 if layout else pool1
    results = pool.run(f"{__name__}:aux_grad_job", path=moe_path, layout=layout)
    result = {"rows": results[0]["rows"], "grads": {k: v for r in results for k, v in r["grads"].items()}}
    assert [len(r) for r in result["rows"]] == [3, 3, 2]
    expected = _hf_aux_grads(moe_path, result["rows"])
    # The last layer's experts come after every router: the aux loss gives them no gradient.
    last = [n for n in result["grads"] if n.startswith(f"model.layers.{LAYERS - 1}.mlp.experts.")]
    assert len(last) == 3 * EXPERTS and all(torch.count_nonzero(result["grads"][n]) == 0 for n in last)
    router = expected["model.layers.0.mlp.gate.weight"]
    assert router.abs().max() > 1e-3  # the aux loss does move the router
    scale = max(float(g.abs().max()) for g in expected.values())
    assert_close_report(result["grads"], expected, rtol=1e-4, atol=1e-5 * scale, what="aux-loss grads")
