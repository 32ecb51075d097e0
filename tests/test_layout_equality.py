"""One training step of a tiny GPTModel gives the same numbers under every layout.

Each layout runs forward_backward_func + megatron DDP + the megatron optimizer
with gradient clipping on the same global batch, from the same weights (set by
global parameter name, so identical whatever the sharding). The single-process
run is the reference; tp=2, pp=2 (1F1B, 4 micro-batches), dp=2 and pp=2 with
virtual stages must reproduce its losses, gradient norm and updated weights.
"""

from __future__ import annotations

import pytest
import torch

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 16, 32, 4, 4, 2, 64
GLOBAL_BATCH, MICRO_BATCH = 8, 1


def _global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    # Uneven valid lengths so token-count normalisation matters.
    lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL_BATCH,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).float()
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def _make_gpt(pre: bool, post: bool, vp_stage):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        add_bias_linear=False,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )


def train_step_job(tp: int, pp: int, vpp: int | None, num_steps: int = 2) -> dict:
    """Runs on every rank: `num_steps` optimizer steps; returns losses, grad norms, new weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_chunks,
        build_optimizer,
        wrap_ddp,
        zero_grads,
    )
    from verl_megatron.models.sharding import gather_full_state, load_full_state, seeded_tensor

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp, vpp=vpp), seed=7)
    runtime.layout.check_model(num_layers=LAYERS, num_attention_heads=HEADS, num_query_groups=GROUPS)
    chunks = build_chunks(runtime, _make_gpt)
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=3))
    chunks = wrap_ddp(chunks)
    attach_schedule_hooks(chunks)
    # clip_grad is small enough that clipping really scales the gradients.
    optimizer = build_optimizer(chunks, OptimSettings(lr=1e-2, weight_decay=0.0, clip_grad=0.05))

    dp, dp_rank = runtime.layout.dp, ps.get_data_parallel_rank()
    batch = _global_batch()
    total_tokens = batch["loss_mask"].sum()
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    shard = {k: v[rows] for k, v in batch.items()}
    num_micro = shard["input_ids"].shape[0] // MICRO_BATCH

    def micro_batches():
        for i in range(num_micro):
            yield {k: v[i * MICRO_BATCH : (i + 1) * MICRO_BATCH] for k, v in shard.items()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
        output = model(mb["input_ids"], positions, None, labels=mb["labels"])

        def loss_func(per_token_loss):
            token_sum = (per_token_loss * mb["loss_mask"]).sum()
            # Global token mean: the schedule divides by num_micro and DDP
            # averages over dp, so both are multiplied back in.
            loss = token_sum / total_tokens * dp * num_micro
            return loss, {"token_sum": token_sum.detach()}

        return output, loss_func

    losses, grad_norms, first_grads = [], [], {}
    for step in range(num_steps):
        zero_grads(chunks, optimizer)
        iterators = [micro_batches() for _ in chunks] if len(chunks) > 1 else micro_batches()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_micro,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        if step == 0:
            first_grads = gather_full_state(chunks, grads=True)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        local = torch.tensor(sum(float(o["token_sum"]) for o in out) if out else 0.0, dtype=torch.float64)
        # Loss lives on the last pipeline stage of each dp replica; sum it over everyone.
        if ps.get_tensor_model_parallel_rank() != 0:
            local.zero_()
        torch.distributed.all_reduce(local)
        losses.append(float(local) / float(total_tokens))
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
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-5, atol=1e-6
    )
    assert run["grads"].keys() == ref["grads"].keys() == ref["weights"].keys() == run["weights"].keys()
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(
            run["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=f"grad of {name} differs"
        )
    # Adam divides by sqrt(v): where a gradient is ~0, float32 summation-order
    # noise can move one element by a sizeable fraction of lr. 2e-5 is 0.1% of
    # one lr=1e-2 step per step taken.
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(
            run["weights"][name], tensor, rtol=0, atol=2e-5, msg=f"weight {name} differs"
        )


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
