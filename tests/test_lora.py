"""LoRA on megatron's tensor-parallel linears: tp=2, pp=2 and dp=2 updates equal one process.

Float64 jobs (as tests/test_layout_equality.py) train the adapters of a tiny GQA GPTModel for
two steps from the same weights and adapters (set by global name), with grouped-query fused
qkv (two key/value groups per tp rank, so the per-group interleaving is exercised), fused
gate/up, clipping and weight decay. Only the adapters may change: every base weight must come
back bit-identical, and megatron's optimizer must hold state for the adapters alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.closeness import assert_close_report
from tests.tiny_gpt import global_token_loss, make_gpt, run_schedule, token_mean_schedule, uneven_batch

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 12, 32, 2, 8, 4, 48
GLOBAL_BATCH, MICRO_BATCH, NUM_STEPS, LR = 4, 1, 2, 1e-2
RANK, ALPHA = 4, 8.0


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    return uneven_batch(VOCAB, GLOBAL_BATCH, SEQ, seed, mask_dtype=torch.float64)


def _make_gpt(pre: bool, post: bool, vp_stage):
    return make_gpt(
        pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
        groups=GROUPS, ffn=FFN, gated_linear_unit=True,
    )  # fmt: skip


def lora_train_job(
    tp: int,
    pp: int,
    targets: tuple[str, ...] | None,
    steps: int = NUM_STEPS,
    save_dir: str | None = None,
    load_dir: str | None = None,
) -> dict:
    """Runs on every rank: ``steps`` float64 adapter updates; losses, norms, adapters, base weights.

    ``targets=None`` trains every weight (no LoRA). ``load_dir``: resume from that checkpoint
    first (an error is returned as ``load_error``); ``save_dir``: checkpoint after the steps.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _lora_steps(tp, pp, targets, steps, save_dir, load_dir)
    finally:
        torch.set_default_dtype(previous)


def _lora_steps(tp, pp, targets, steps, save_dir, load_dir) -> dict:
    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.lora import LoraSettings, apply_lora
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_chunks,
        build_optimizer,
        wrap_ddp,
        zero_grads,
    )
    from verl_megatron.models.sharding import gather_full_state, load_full_state

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=7)
    chunks = build_chunks(runtime, _make_gpt)
    if targets is not None:
        apply_lora(chunks, LoraSettings(RANK, ALPHA, targets))
    # Base and adapters from their global names; B non-zero so A gets a gradient at step 1.
    load_full_state(chunks, lambda name, shape: _initial(name, shape, tp))
    base_before = {k: v for k, v in gather_full_state(chunks).items() if not k.startswith("lora_adapters.")}
    settings = OptimSettings(lr=LR, weight_decay=0.1, clip_grad=0.05, grad_reduce_in_fp32=False)
    chunks = wrap_ddp(chunks, settings)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, settings)
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    if load_dir is not None:
        from verl_megatron.checkpoint.manager import load_checkpoint
        from verl_megatron.checkpoint.storage import CheckpointMismatchError

        try:
            load_checkpoint(load_dir, chunks=chunks, optimizer=optimizer, runtime=runtime)
        except CheckpointMismatchError as err:
            return {"load_error": str(err)}

    batch = _batch()
    total_tokens = batch["loss_mask"].sum()
    micro_batches, forward_step, num_micro = token_mean_schedule(
        batch, micro_batch=MICRO_BATCH, seq=SEQ, dp=runtime.layout.dp, dp_rank=ps.get_data_parallel_rank()
    )

    losses, grad_norms = [], []
    for _ in range(steps):
        zero_grads(chunks, optimizer)
        out = run_schedule(chunks, micro_batches, forward_step, num_micro, seq=SEQ, micro_batch=MICRO_BATCH)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(global_token_loss(runtime, out, total_tokens))
        grad_norms.append(float(grad_norm))
    if save_dir is not None:
        from verl_megatron.checkpoint.manager import save_checkpoint

        save_checkpoint(save_dir, steps, chunks=chunks, optimizer=optimizer, runtime=runtime)
    after = gather_full_state(chunks)
    adapters = {k: v for k, v in after.items() if k.startswith("lora_adapters.")}
    base_after = {k: v for k, v in after.items() if not k.startswith("lora_adapters.")}
    trainable = {id(p) for _, p in chunks[0].module.named_parameters() if p.requires_grad}
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "adapters": adapters,
        "base_unchanged": all(torch.equal(base_after[k], v) for k, v in base_before.items())
        and base_after.keys() == base_before.keys(),
        "optimizer_holds_adapters_only": {id(p) for p in optimized} == trainable
        and all(p.requires_grad for p in optimized),
        "adapter_count": len(trainable),
        "state_bytes": sum(
            t.numel() * t.element_size()
            for state in optimizer.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        ),
    }


def _initial(name: str, shape: tuple[int, ...], tp: int) -> torch.Tensor:
    """The same function under every tp: fused gate/up is [gate_0; up_0; gate_1; up_1; ...] per tp."""
    from verl_megatron.models.sharding import seeded_tensor

    if not name.endswith("linear_fc1.weight"):
        return seeded_tensor(name, shape, seed=3)
    half = (shape[0] // 2, shape[1])
    gate, up = seeded_tensor(name + ".gate", half, seed=3), seeded_tensor(name + ".up", half, seed=3)
    return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))])


def _merge(results: list[dict]) -> dict:
    adapters: dict[str, torch.Tensor] = {}
    for r in results:
        adapters.update(r["adapters"])
    return {"losses": results[0]["losses"], "grad_norms": results[0]["grad_norms"], "adapters": adapters}


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def reference(pool1):
    (result,) = pool1.run(f"{__name__}:lora_train_job", tp=1, pp=1, targets=ALL)
    return result


def test_single_process_lora_step_trains_adapters_only(reference):
    assert reference["base_unchanged"]
    assert reference["optimizer_holds_adapters_only"]
    # 2 layers x 7 projections x (A, B).
    assert reference["adapter_count"] == LAYERS * 7 * 2
    assert reference["losses"][1] < reference["losses"][0]
    assert reference["grad_norms"][0] > 0.05  # clipping active
    name = "lora_adapters.layers.1.self_attention__linear_qkv.pairs.k_proj.lora_A"
    start = _seeded(name, reference["adapters"][name].shape)
    assert (reference["adapters"][name] - start).abs().max() > 1e-3


def _seeded(name, shape):
    from verl_megatron.models.sharding import seeded_tensor

    return seeded_tensor(name, tuple(shape), seed=3).double()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_lora_layout_matches_single_process(pool2, reference, tp, pp):
    results = pool2.run(f"{__name__}:lora_train_job", tp=tp, pp=pp, targets=ALL)
    assert all(r["base_unchanged"] and r["optimizer_holds_adapters_only"] for r in results)
    run = _merge(results)
    assert_close_report(run["losses"], reference["losses"], rtol=1e-12, atol=0, what="losses")
    # get_grad_norm_fp32 rounds to float32 (see test_layout_equality); Adam's step then moves by
    # at most lr * 2^-23 per step through the clip coefficient.
    assert_close_report(run["grad_norms"], reference["grad_norms"], rtol=1e-6, atol=0, what="grad norms")
    atol = NUM_STEPS * LR * 2.0**-23
    assert_close_report(run["adapters"], reference["adapters"], rtol=0, atol=atol, what="adapters")


def _tensor_keys(root) -> list[str]:
    from megatron.core import dist_checkpointing

    from verl_megatron.checkpoint import storage

    return sorted(dist_checkpointing.load_tensors_metadata(str(storage.resolve_part(root, "model"))))


def test_lora_checkpoint_holds_adapters_and_resumes_under_another_layout(pool1, pool2, reference, tmp_path):
    lora_dir, full_dir = str(tmp_path / "lora"), str(tmp_path / "full")
    # One step at tp=2, saved; one more step at tp=1 from that checkpoint = two steps at tp=1.
    pool2.run(f"{__name__}:lora_train_job", tp=2, pp=1, targets=ALL, steps=1, save_dir=lora_dir)
    keys = _tensor_keys(lora_dir)
    assert keys and all(k.startswith(("layers.", "optimizer.state.")) for k in keys), keys[:5]
    assert all(k.split(".", 3)[3].startswith("layers.") for k in keys if k.startswith("optimizer.state."))
    assert not [k for k in keys if "decoder" in k or "embedding" in k or "output_layer" in k]
    (resumed,) = pool1.run(f"{__name__}:lora_train_job", tp=1, pp=1, targets=ALL, steps=1, load_dir=lora_dir)
    assert resumed["base_unchanged"]
    assert_close_report(resumed["losses"], reference["losses"][1:], rtol=1e-12, atol=0, what="resumed loss")
    atol = NUM_STEPS * LR * 2.0**-23
    assert_close_report(
        resumed["adapters"], reference["adapters"], rtol=0, atol=atol, what="resumed adapters"
    )

    # Full weights and adapters-only checkpoints do not resume each other: one named line.
    (full_run,) = pool1.run(
        f"{__name__}:lora_train_job", tp=1, pp=1, targets=None, steps=1, save_dir=full_dir
    )
    (err,) = pool1.run(f"{__name__}:lora_train_job", tp=1, pp=1, targets=ALL, steps=1, load_dir=full_dir)
    assert (
        "holds full model weights, but this run trains LoRA adapters (model.lora_rank=4)" in err["load_error"]
    )
    (err,) = pool1.run(f"{__name__}:lora_train_job", tp=1, pp=1, targets=None, steps=1, load_dir=lora_dir)
    assert "holds only LoRA adapters (rank 4, alpha 8, on q_proj" in err["load_error"]
    assert "model.lora_rank=4 model.lora_alpha=8 model.target_modules=[q_proj," in err["load_error"]
    (err,) = pool1.run(
        f"{__name__}:lora_train_job", tp=1, pp=1, targets=("q_proj",), steps=1, load_dir=lora_dir
    )
    assert "but this run's have rank 4, alpha 8, on q_proj:" in err["load_error"]
    assert all("\n" not in e for e in (err["load_error"],))
    # Optimizer state is the adapters' only: a fraction of the full run's.
    assert 0 < resumed["state_bytes"] < full_run["state_bytes"] / 4


def dropout_job() -> dict:
    """Logits of one batch: LoRA dropout 0.5 in train mode (twice), in eval mode, and without dropout."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
        from verl_megatron.models.lora import LoraSettings, apply_lora
        from verl_megatron.models.megatron_model import build_chunks
        from verl_megatron.models.sharding import load_full_state

        init_runtime(ParallelLayout(), seed=7)
        out = {}
        for dropout in (0.5, 0.0):
            chunks = build_chunks(init_runtime(ParallelLayout(), seed=7), _make_gpt)
            apply_lora(chunks, LoraSettings(RANK, ALPHA, ALL, dropout=dropout))
            load_full_state(chunks, lambda name, shape: _initial(name, shape, 1))
            batch = _batch()
            positions = torch.arange(SEQ).unsqueeze(0).expand(GLOBAL_BATCH, -1)
            with torch.no_grad():
                for mode in ("train_a", "train_b", "eval"):
                    chunks[0].train(mode != "eval")
                    out[f"{mode}_{dropout}"] = chunks[0](batch["input_ids"], positions, None)
        return out
    finally:
        torch.set_default_dtype(previous)


def test_lora_dropout_applies_in_training_only(pool1):
    (out,) = pool1.run(f"{__name__}:dropout_job")
    assert float((out["train_a_0.5"] - out["train_b_0.5"]).abs().max()) > 1e-3  # a new mask per call
    assert torch.equal(out["eval_0.5"], out["eval_0.0"])  # eval: the adapters without dropout
    assert torch.equal(out["train_a_0.0"], out["eval_0.0"])
