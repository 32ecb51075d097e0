"""megatron's distributed optimizer on CPU (gloo): dp=2 equals one process (issue 18 items 3, 4).

The job is test_layout_equality's two training steps of a tiny GPTModel, with the DDP wrapping
and optimizer built from one ``OptimSettings`` (``wrap_ddp`` + ``build_optimizer``). With the
distributed optimizer each dp rank holds a reduced shard of the gradient buffer after the
backward pass; the shards are all-gathered before comparing gradients. Tolerances: those of
test_layout_equality (its plain dp=2 run meets them).

Virtual pipeline stages with dp=2 run on 4 ranks (pp=2 x vpp=2 x dp=2, with and without the
distributed optimizer); on 2 ranks (pp=2, vpp=2, dp=1) the count of gradient reductions per bucket
and step pins the double reduction down too (item 4).
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from tests.closeness import assert_close_report
from tests.test_layout_equality import (
    GROUPS,
    HEADS,
    LAYERS,
    MICRO_BATCH,
    SEQ,
    _assert_same,
    _global_batch,
    _make_gpt,
    _merge,
)
from tests.tiny_gpt import global_token_loss, run_schedule, seeded_chunks, token_mean_schedule


def _gather_grad_shards(chunks, dp_group) -> None:
    """Every rank's reduced gradient shard -> the whole reduced buffer on every rank (in place)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    size, rank = torch.distributed.get_world_size(dp_group), torch.distributed.get_rank(dp_group)
    for chunk in chunks:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                shard = shard_buffer(bucket.grad_data, size)[rank].clone()
                torch.distributed.all_gather_into_tensor(bucket.grad_data, shard, group=dp_group)


def distopt_job(
    tp: int, pp: int, vpp: int | None, settings: dict, num_steps: int = 2, dtype: str = "float64"
) -> dict:
    """Two optimizer steps; returns losses, grad norms, first-step grads and final weights.

    float64 as test_layout_equality, except with megatron's distributed optimizer, which takes
    only float32/16 parameters.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        return _distopt_steps(tp, pp, vpp, settings, num_steps, getattr(torch, dtype))
    finally:
        torch.set_default_dtype(previous)


def _distopt_steps(
    tp: int, pp: int, vpp: int | None, settings: dict, num_steps: int, dtype: torch.dtype
) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_optimizer,
        gather_updated_params,
        wrap_ddp,
        zero_grads,
    )
    from verl_megatron.models.sharding import gather_full_state

    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp)
    make = functools.partial(_make_gpt, dtype=dtype)
    runtime, chunks = seeded_chunks(layout, make, layers=LAYERS, heads=HEADS, groups=GROUPS)
    fp64 = dtype == torch.float64
    optim = OptimSettings(lr=1e-2, weight_decay=0.0, clip_grad=0.05, grad_reduce_in_fp32=not fp64, **settings)
    chunks = wrap_ddp(chunks, optim)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, optim)

    reductions: list[int] = []
    original = _ParamAndGradBucketGroup.start_grad_sync

    def counted(self, *args, **kwargs):
        # megatron makes a call a no-op when the overlapped collective was already dispatched.
        if not (self.is_first_batch and self.grad_reduce_handle is not None):
            reductions.append(id(self))
        return original(self, *args, **kwargs)

    dp, dp_rank = runtime.layout.dp, ps.get_data_parallel_rank()
    batch = _global_batch()
    total_tokens = batch["loss_mask"].sum()
    micro_batches, forward_step, num_micro = token_mean_schedule(
        batch, micro_batch=MICRO_BATCH, seq=SEQ, dp=dp, dp_rank=dp_rank
    )

    losses, grad_norms, first_grads, counts = [], [], {}, []
    _ParamAndGradBucketGroup.start_grad_sync = counted
    try:
        for step in range(num_steps):
            zero_grads(chunks, optimizer)
            reductions.clear()
            out = run_schedule(
                chunks, micro_batches, forward_step, num_micro, seq=SEQ, micro_batch=MICRO_BATCH
            )
            counts.append(sorted({reductions.count(g) for g in reductions}))
            if step == 0:
                if optim.use_distributed_optimizer:
                    # Copies: the optimizer must still see the buffers as they are.
                    saved = [b.grad_data.clone() for c in chunks for b in c.buffers]
                    _gather_grad_shards(chunks, runtime.dp_group())
                first_grads = gather_full_state(chunks, grads=True)
                if optim.use_distributed_optimizer:
                    for b, data in zip([b for c in chunks for b in c.buffers], saved):
                        b.grad_data.copy_(data)
            ok, grad_norm, _ = optimizer.step()
            assert ok
            losses.append(global_token_loss(runtime, out, total_tokens))
            grad_norms.append(float(grad_norm))
    finally:
        _ParamAndGradBucketGroup.start_grad_sync = original
    gather_updated_params(chunks)
    weights = gather_full_state(chunks)
    sharded = [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]]
    if dp_rank != 0:
        weights, first_grads = {}, {}
    return {"losses": losses, "grad_norms": grad_norms, "weights": weights, "grads": first_grads,
            "reductions_per_bucket": counts, "optimizers": sharded}  # fmt: skip


@pytest.fixture(scope="module")
def reference(pool1):
    return _merge(pool1.run(f"{__name__}:distopt_job", tp=1, pp=1, vpp=None, settings={}))


@pytest.fixture(scope="module")
def reference32(pool1):
    return _merge(pool1.run(f"{__name__}:distopt_job", tp=1, pp=1, vpp=None, settings={}, dtype="float32"))


def _assert_same_fp32(run: dict, ref: dict) -> None:
    """float32 equality: summation-order noise only (tolerances measured on the plain dp=2 run)."""
    assert_close_report(run["losses"], ref["losses"], rtol=1e-5, atol=1e-6, what="losses")
    assert_close_report(run["grad_norms"], ref["grad_norms"], rtol=1e-5, atol=1e-6, what="grad norms")
    assert_close_report(run["grads"], ref["grads"], rtol=1e-5, atol=1e-7, what="step-1 gradients")
    # Adam divides by sqrt(v): where a gradient is ~0, float32 summation-order noise can move one
    # element by a sizeable fraction of lr; 2e-5 is 0.1% of one lr=1e-2 step per step taken.
    assert_close_report(run["weights"], ref["weights"], rtol=0, atol=2e-5, what="updated weights")


DISTOPT = {"use_distributed_optimizer": True}


@pytest.mark.parametrize(
    "settings",
    [DISTOPT, {**DISTOPT, "overlap_grad_reduce": True}, {**DISTOPT, "overlap_grad_reduce": True,
                                                         "overlap_param_gather": True}],
    ids=["distopt", "distopt-overlap-grad", "distopt-overlap-grad-and-param"],
)  # fmt: skip
def test_distributed_optimizer_at_dp2_matches_one_process(pool2, reference32, settings):
    results = pool2.run(f"{__name__}:distopt_job", tp=1, pp=1, vpp=None, settings=settings, dtype="float32")
    assert results[0]["optimizers"] == ["DistributedOptimizer"]
    run = _merge(results)
    _assert_same_fp32(run, reference32)
    # Each bucket group reduced once per step.
    assert all(c == [1] for r in results for c in r["reductions_per_bucket"])


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_vpp_reduces_each_bucket_once_per_step(pool2, reference, overlap):
    """pp=2 x vpp=2 on 2 ranks (dp=1): one reduction per bucket group and step, same numbers."""
    settings = {"overlap_grad_reduce": overlap}
    results = pool2.run(f"{__name__}:distopt_job", tp=1, pp=2, vpp=2, settings=settings)
    for r in results:
        assert all(c == [1] for c in r["reductions_per_bucket"]), r["reductions_per_bucket"]
    _assert_same(_merge(results), reference)


_JOB_IMPORTS = (
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "verl_megatron.models.megatron_model",
    "verl_megatron.models.sharding",
)


@pytest.fixture(scope="module")
def pool4():
    """pp=2 x vpp=2 x dp=2 needs 4 ranks. They are forked from this process once it has imported
    what the job needs: 4 fresh interpreters importing megatron cost ~24 CPU s, the jobs ~1 s."""
    from verl_megatron.distributed.dist_pool import DistPool

    for module in _JOB_IMPORTS:
        importlib.import_module(module)
    pool = DistPool(4, start_method="fork")
    yield pool
    pool.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_vpp_with_dp2_matches_one_process(pool4, reference, overlap):
    """pp=2 x vpp=2 x dp=2 (float64): one process's numbers, one reduction per bucket group and step."""
    results = pool4.run(
        f"{__name__}:distopt_job", tp=1, pp=2, vpp=2, settings={"overlap_grad_reduce": overlap}
    )
    for r in results:
        assert all(c == [1] for c in r["reductions_per_bucket"]), r["reductions_per_bucket"]
    _assert_same(_merge(results), reference)


@pytest.mark.parametrize(
    "settings",
    [DISTOPT, {**DISTOPT, "overlap_grad_reduce": True, "overlap_param_gather": True}],
    ids=["distopt", "distopt-overlap"],
)
def test_distributed_optimizer_with_vpp_and_dp2_matches_one_process(pool4, reference32, settings):
    """The reduce-scatter case item 4 was about: a second reduction would corrupt the shards."""
    results = pool4.run(f"{__name__}:distopt_job", tp=1, pp=2, vpp=2, settings=settings, dtype="float32")
    assert results[0]["optimizers"] == ["DistributedOptimizer"]
    _assert_same_fp32(_merge(results), reference32)
    for r in results:
        assert all(c == [1] for c in r["reductions_per_bucket"]), r["reductions_per_bucket"]


def test_settings_must_agree_between_wrapping_and_optimizer():
    from verl_megatron.errors import WorkerConfigError
    from verl_megatron.models.megatron_model import OptimSettings, build_optimizer
    from verl_megatron.workers.config import OptimConfig

    with pytest.raises(
        WorkerConfigError, match=r"overlap_param_gather=true needs optim.use_distributed_optimizer"
    ):
        OptimConfig(overlap_param_gather=True)
    with pytest.raises(ValueError, match=r"needs optim.use_distributed_optimizer=True"):
        build_optimizer([], OptimSettings(overlap_param_gather=True))

    class Wrapped(torch.nn.Module):
        ddp_config = OptimSettings()  # any object with the two fields

    with pytest.raises(ValueError, match=r"optim.use_distributed_optimizer=True but the model was wrapped"):
        build_optimizer([Wrapped()], OptimSettings(use_distributed_optimizer=True))


def test_distributed_optimizer_with_checkpoints_is_accepted():
    """Its checkpoints round-trip (tests/test_distopt_checkpoint.py): no start-up refusal."""
    from tests.test_config import QUICKSTART
    from verl_megatron.trainer.config import load_config, validate_config

    overrides = [
        "actor.optim.use_distributed_optimizer=true",
        "trainer.save_freq=5",
        "trainer.resume_mode=auto",
    ]
    validate_config(load_config(QUICKSTART, overrides), 1)
