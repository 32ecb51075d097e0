"""One training step of a tiny GPTModel gives the same numbers under every layout.

Each layout runs forward_backward_func + megatron DDP + the megatron optimizer
with gradient clipping on the same global batch, from the same weights (set by
global parameter name, so identical whatever the sharding). The single-process
run is the reference; tp=2, pp=2 (1F1B, 4 micro-batches), dp=2 and pp=2 with
virtual stages must reproduce its losses, gradient norm and updated weights.

The jobs run in float64 so that equality is a proof rather than a tolerance
guess: in float32 the sums of different layouts round differently, and Adam
amplifies that noise where a gradient is near its eps (a tp=2 weight element
moved 3e-5 away from one process, 0.3% of an lr=1e-2 step, from a gradient
of 8e-8 that differed by 1.3e-9). Two float32 steps remain, both identical
in every layout or bounded below: megatron's rotary frequencies (the same
positions everywhere) and ``get_grad_norm_fp32``, which rounds the norm to
float32 (see ``_assert_same``). The loss is computed here in float64 from
the gathered logits, because megatron's vocab-parallel cross-entropy casts
logits to float32.
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import assert_close_report
from tests.tiny_gpt import (
    global_token_loss,
    make_gpt,
    run_schedule,
    seeded_chunks,
    token_mean_schedule,
    uneven_batch,
)

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 16, 32, 4, 4, 2, 64
GLOBAL_BATCH, MICRO_BATCH = 8, 1
NUM_STEPS, LR = 2, 1e-2


def _global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return uneven_batch(VOCAB, GLOBAL_BATCH, SEQ, seed)


def _make_gpt(pre: bool, post: bool, vp_stage, dtype: torch.dtype = torch.float64):
    return make_gpt(
        pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
        groups=GROUPS, ffn=FFN, dtype=dtype,
    )  # fmt: skip


def train_step_job(tp: int, pp: int, vpp: int | None) -> dict:
    """Runs on every rank: NUM_STEPS float64 optimizer steps; returns losses, grad norms, new weights."""
    previous = torch.get_default_dtype()
    # Modules that take no dtype argument (megatron's torch RMSNorm) follow the default.
    torch.set_default_dtype(torch.float64)
    try:
        return _train_steps(tp, pp, vpp)
    finally:
        torch.set_default_dtype(previous)


def _train_steps(tp: int, pp: int, vpp: int | None) -> dict:
    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_optimizer,
        wrap_ddp,
        zero_grads,
    )
    from verl_megatron.models.sharding import gather_full_state

    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp)
    runtime, chunks = seeded_chunks(layout, _make_gpt, layers=LAYERS, heads=HEADS, groups=GROUPS)
    # clip_grad is small enough that clipping really scales the gradients; grads are not
    # reduced in float32, so the float64 gradients stay float64.
    settings = OptimSettings(lr=LR, weight_decay=0.0, clip_grad=0.05, grad_reduce_in_fp32=False)
    chunks = wrap_ddp(chunks, settings)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, settings)

    batch = _global_batch()
    total_tokens = batch["loss_mask"].sum()
    micro_batches, forward_step, num_micro = token_mean_schedule(
        batch, micro_batch=MICRO_BATCH, seq=SEQ, dp=runtime.layout.dp, dp_rank=ps.get_data_parallel_rank()
    )

    losses, grad_norms, first_grads = [], [], {}
    for step in range(NUM_STEPS):
        zero_grads(chunks, optimizer)
        out = run_schedule(chunks, micro_batches, forward_step, num_micro, seq=SEQ, micro_batch=MICRO_BATCH)
        if step == 0:
            first_grads = gather_full_state(chunks, grads=True)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(global_token_loss(runtime, out, total_tokens))
        grad_norms.append(float(grad_norm))
    weights = gather_full_state(chunks)
    if ps.get_data_parallel_rank() != 0:
        weights, first_grads = {}, {}
    return {"losses": losses, "grad_norms": grad_norms, "weights": weights, "grads": first_grads}


def _merge(results: list[dict]) -> dict:
    weights: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        weights.update(r["weights"])
        grads.update(r["grads"])
    return {
        "losses": results[0]["losses"],
        "grad_norms": results[0]["grad_norms"],
        "weights": weights,
        "grads": grads,
    }


@pytest.fixture(scope="module")
def reference(pool1):
    return _merge(pool1.run(f"{__name__}:train_step_job", tp=1, pp=1, vpp=None))


def _assert_same(run: dict, ref: dict) -> None:
    # float64 sums of different orders agree to ~1e-15 relative; 1e-12 leaves room for
    # the few thousand operations between the weights and each number.
    assert_close_report(run["losses"], ref["losses"], rtol=1e-12, atol=0, what="losses")
    assert_close_report(run["grads"], ref["grads"], rtol=1e-9, atol=1e-13, what="step-1 gradients")
    # megatron's get_grad_norm_fp32 rounds each rank's norm to float32 and sums the squares
    # in float32: a relative error of a few 2^-24 (measured up to 4e-8 under pp=2).
    assert_close_report(run["grad_norms"], ref["grad_norms"], rtol=1e-6, atol=0, what="grad norms")
    # Through the clip coefficient that error scales every gradient by (1 + d), d <= 2^-23.
    # Adam's step m/(sqrt(v) + eps) is scale-invariant up to eps, so each step moves by at
    # most lr * d: NUM_STEPS * LR * 2^-23 = 2.4e-9 (measured up to 2.4e-10 under pp=2).
    atol = NUM_STEPS * LR * 2.0**-23
    assert_close_report(run["weights"], ref["weights"], rtol=0, atol=atol, what="updated weights")


def test_reference_step_moves_weights_and_clips(reference):
    from verl_megatron.models.sharding import seeded_tensor

    # The reference itself must be a real step: loss finite, gradients clipped, weights changed.
    assert all(0.0 < loss < 10.0 for loss in reference["losses"])
    assert reference["grad_norms"][0] > 0.05  # above clip_grad, so clipping was active
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    start = seeded_tensor(name, reference["weights"][name].shape, seed=3)
    assert (reference["weights"][name] - start).abs().max() > 1e-4
    assert reference["losses"][1] < reference["losses"][0]


@pytest.mark.parametrize(
    ("tp", "pp", "vpp"),
    [(1, 1, None), (2, 1, None), (1, 2, None), (1, 2, 2)],
    ids=["dp2", "tp2", "pp2-1f1b", "pp2-vpp2"],
)
def test_layout_matches_single_process(pool2, reference, tp, pp, vpp):
    run = _merge(pool2.run(f"{__name__}:train_step_job", tp=tp, pp=pp, vpp=vpp))
    _assert_same(run, reference)
