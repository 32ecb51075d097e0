"""Checkpoints of a tiny megatron GPT: exact round trips, other layouts, interrupted saves, bad input.

A job trains a few steps (dropout on, so the RNG streams matter; an LR/WD
scheduler, so its state matters), saves, and reports what it holds as whole
tensors by global name. Loading jobs start from different weights and must
end with exactly the saved ones. Resharding is a pure copy, so even across
layouts weights and Adam moments must be bit-identical.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 8, 32, 4, 4, 2, 48
BATCH, MICRO = 4, 2


def _make_gpt(pre: bool, post: bool, vp_stage, hidden: int = HIDDEN):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=hidden,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        # Dropout makes the next step depend on the restored RNG streams.
        hidden_dropout=0.1,
        attention_dropout=0.0,
        normalization="RMSNorm",
        add_bias_linear=False,
        # SwiGLU: fc1 is saved through a ShardedTensorFactory (gate and up halves).
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
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


def _setup(tp: int, pp: int, vpp: int | None, init_seed: int, hidden: int = HIDDEN):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_chunks,
        build_optimizer,
        wrap_ddp,
    )
    from verl_megatron.models.sharding import load_full_state, seeded_tensor

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp, vpp=vpp), seed=11)
    chunks = build_chunks(runtime, lambda pre, post, vp: _make_gpt(pre, post, vp, hidden))
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=init_seed))
    chunks = wrap_ddp(chunks)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, OptimSettings(lr=1e-2, weight_decay=0.05, clip_grad=1.0))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="linear",
    )
    return runtime, chunks, optimizer, scheduler


def _train_step(runtime, chunks, optimizer, scheduler, step: int) -> float:
    """One optimizer step on batch ``step``; returns the summed token loss over the whole job."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from verl_megatron.models.megatron_model import zero_grads

    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    dp, dp_rank = runtime.layout.dp, ps.get_data_parallel_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    ids, labels = tokens[rows, :-1], tokens[rows, 1:]
    num_micro = ids.shape[0] // MICRO

    def micro_batches():
        for i in range(num_micro):
            yield ids[i * MICRO : (i + 1) * MICRO], labels[i * MICRO : (i + 1) * MICRO]

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(x.shape[0], -1)
        out = model(x, positions, None, labels=y)
        return out, lambda per_token: (per_token.mean(), {"sum": per_token.sum().detach()})

    zero_grads(chunks, optimizer)
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[micro_batches() for _ in chunks] if len(chunks) > 1 else micro_batches(),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_micro,
        seq_length=SEQ,
        micro_batch_size=MICRO,
        forward_only=False,
    )
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    return float(sum(float(o["sum"]) for o in out)) if out else 0.0


def _torch_optimizers(optimizer):
    return [sub.optimizer for sub in optimizer.chained_optimizers]


def _snapshot(chunks, optimizer, scheduler) -> dict:
    """Whole weights and Adam moments by global name (dp rank 0 / tp rank 0), scheduler state."""
    from megatron.core import parallel_state as ps

    from verl_megatron.models.sharding import gather_full_state, gather_tp, named_global_parameters

    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    state = {}
    for opt in _torch_optimizers(optimizer):
        state.update(opt.state)
    moments, steps = {}, set()
    for name, param in named_global_parameters(chunks):
        if state.get(param):
            steps.add(int(state[param]["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                moments[f"{name}:{key}"] = gather_tp(state[param][key], param, tp_group, tp_size)
    weights = gather_full_state(chunks)
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    return {
        "weights": weights if keep else {},
        "moments": moments if keep else {},
        "adam_steps": sorted(steps),
        "scheduler": scheduler.state_dict(),
        "lr": [g["lr"] for g in optimizer.param_groups],
    }


def save_job(root: str, tp: int, pp: int, vpp: int | None, steps: int, then: int = 1) -> dict:
    """Train ``steps`` steps, save at ``steps``, report, then train ``then`` more steps and report again."""
    from verl_megatron.checkpoint import save_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(tp, pp, vpp, init_seed=3)
    for step in range(steps):
        _train_step(runtime, chunks, optimizer, scheduler, step)
    extra = {"global_steps": steps, "dataloader": {"epoch": 1, "index": 7}, "kl_coef": 0.0125}
    save_checkpoint(
        root, steps, chunks=chunks, optimizer=optimizer, scheduler=scheduler, extra_state=extra, runtime=runtime
    )
    saved = _snapshot(chunks, optimizer, scheduler)
    losses = [_train_step(runtime, chunks, optimizer, scheduler, steps + i) for i in range(then)]
    return {"saved": saved, "after": _snapshot(chunks, optimizer, scheduler), "losses": losses}


def load_job(root: str, tp: int, pp: int, vpp: int | None, then: int = 0) -> dict:
    """Fresh model (other weights), load, report, then train ``then`` steps and report again."""
    from verl_megatron.checkpoint import load_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(tp, pp, vpp, init_seed=99)
    # Advance the RNGs so that restoring them is visible.
    torch.rand(5), random.random(), np.random.rand()
    extra = load_checkpoint(root, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime)
    loaded = _snapshot(chunks, optimizer, scheduler)
    step = extra["global_steps"]
    losses = [_train_step(runtime, chunks, optimizer, scheduler, step + i) for i in range(then)]
    return {"extra": extra, "loaded": loaded, "after": _snapshot(chunks, optimizer, scheduler), "losses": losses}


def _merge(results: list[dict], key: str) -> dict:
    out = {"weights": {}, "moments": {}}
    for r in results:
        out["weights"].update(r[key]["weights"])
        out["moments"].update(r[key]["moments"])
    out["scheduler"] = results[0][key]["scheduler"]
    out["lr"] = results[0][key]["lr"]
    out["adam_steps"] = sorted({s for r in results for s in r[key]["adam_steps"]})
    return out


def _assert_identical(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    assert got["moments"].keys() == want["moments"].keys()
    assert len(want["moments"]) == 2 * len(want["weights"])
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), f"weight {name} differs"
    for name, tensor in want["moments"].items():
        assert torch.equal(got["moments"][name], tensor), f"Adam moment {name} differs"
    assert got["scheduler"] == want["scheduler"]
    assert got["adam_steps"] == want["adam_steps"]


@pytest.fixture(scope="module")
def tp2_checkpoint(pool2, tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint saved at step 2 by a tp=2 job, and what that job held then and one step later."""
    root = tmp_path_factory.mktemp("ckpt_tp2")
    return root, pool2.run(f"{__name__}:save_job", root=str(root), tp=2, pp=1, vpp=None, steps=2)


def test_same_layout_round_trip_is_exact(pool2, tp2_checkpoint):
    root, saved = tp2_checkpoint
    loaded = pool2.run(f"{__name__}:load_job", root=str(root), tp=2, pp=1, vpp=None, then=1)
    want = _merge(saved, "saved")
    _assert_identical(_merge(loaded, "loaded"), want)
    # Two Adam steps were taken, the scheduler is past its 2 warmup steps.
    assert want["adam_steps"] == [2]
    assert want["scheduler"]["num_steps"] == 2
    assert want["lr"][0] == pytest.approx(1e-2)
    assert loaded[0]["extra"] == {"global_steps": 2, "dataloader": {"epoch": 1, "index": 7}, "kl_coef": 0.0125}
    # One more step after loading equals one more step without the save/load:
    # same loss (same dropout masks from the restored RNGs) and same state.
    assert [r["losses"] for r in loaded] == [r["losses"] for r in saved]
    _assert_identical(_merge(loaded, "after"), _merge(saved, "after"))


@pytest.mark.parametrize(("tp", "pp", "vpp"), [(1, 2, None), (1, 2, 2)], ids=["pp2", "pp2-vpp2"])
def test_tp2_checkpoint_loads_under_pipeline_layouts(pool2, tp2_checkpoint, tp, pp, vpp):
    root, saved = tp2_checkpoint
    loaded = pool2.run(f"{__name__}:load_job", root=str(root), tp=tp, pp=pp, vpp=vpp)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))


def test_tp2_checkpoint_loads_in_one_process(pool1, tp2_checkpoint):
    root, saved = tp2_checkpoint
    loaded = pool1.run(f"{__name__}:load_job", root=str(root), tp=1, pp=1, vpp=None)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))
    assert loaded[0]["extra"]["kl_coef"] == 0.0125


def test_dp2_save_is_split_over_replicas_and_loads_in_one_process(pool1, pool2, tmp_path):
    saved = pool2.run(f"{__name__}:save_job", root=str(tmp_path), tp=1, pp=1, vpp=None, steps=1, then=0)
    loaded = pool1.run(f"{__name__}:load_job", root=str(tmp_path), tp=1, pp=1, vpp=None)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))
    # The fully-parallel writer spreads the shards of the replicated model over both ranks.
    shard_files = sorted(p.name for p in (tmp_path / "global_step_1" / "model").glob("*.distcp"))
    assert {name.split("_")[2] for name in shard_files} == {"0", "1"}, shard_files
