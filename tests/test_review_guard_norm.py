"""The divergence guard's weight norm: float64-referenced, one host sync, this update's weights."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import torch

from verl_megatron.trainer.guard import global_weight_norm

U32 = 2.0**-24  # float32 unit roundoff


def _model() -> list[torch.nn.Module]:
    gen = torch.Generator().manual_seed(0)
    chunk = torch.nn.Module()
    shapes = {"a": ((33, 17), torch.float32), "b": ((257,), torch.bfloat16), "c": ((5, 7), torch.float64)}
    for name, (shape, dtype) in shapes.items():
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0
        chunk.register_parameter(name, torch.nn.Parameter(values.to(dtype)))
    scaled = torch.nn.Linear(9, 11)
    with torch.no_grad():
        scaled.weight.mul_(1e3)
    return [chunk, scaled]


def _reference(chunks) -> float:
    return math.sqrt(sum(float(p.detach().double().square().sum()) for c in chunks for p in c.parameters()))


def test_the_norm_equals_a_float64_reference_within_the_float32_bound():
    chunks = _model()
    ref = _reference(chunks)
    # Each tensor's norm sums its n squares in float32: relative error <= (n + 2) u32; the
    # squares of the norms are summed in float64.
    bound = (max(p.numel() for c in chunks for p in c.parameters()) + 2) * U32
    got = global_weight_norm(chunks)
    assert abs(got - ref) <= bound * ref, (
        f"norm {got!r} vs float64 {ref!r}: rel diff {abs(got - ref) / ref:.3g} > {bound:.3g}"
    )


def test_weights_past_the_float32_range_and_nan_weights_are_seen_as_before():
    huge = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        huge.weight.fill_(2.0**66)  # a float32 norm of these overflows; the float64 one is 2^68
    assert global_weight_norm([huge]) == _reference([huge]) == 2.0**68
    with torch.no_grad():
        huge.weight[1, 2] = float("nan")
    assert math.isnan(global_weight_norm([huge]))


def test_one_host_sync_per_norm(monkeypatch):
    from tests.test_host_syncs import counting_syncs

    counts: Counter = Counter()
    to_host = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        counts["cpu"] += 1
        return to_host(self, *args, **kwargs)

    chunks = _model()
    assert sum(1 for c in chunks for _ in c.parameters()) == 5
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    with counting_syncs(counts):
        global_weight_norm(chunks)
    assert sum(counts.values()) == 1, dict(counts)


class _Sharded(torch.nn.Module):
    """A chunk whose distributed optimizer left this update's weights to a later all-gather."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3, 4), 2.0))
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=True)
        self.syncs: list[bool] = []

    def start_param_sync(self, force_sync: bool = False) -> None:
        self.syncs.append(force_sync)
        with torch.no_grad():
            self.weight.fill_(3.0)  # the other ranks' shards of the update arrive


def test_the_pending_parameter_all_gather_is_completed_first():
    chunk = _Sharded()
    got = global_weight_norm([chunk])  # not the 2.0s it held before the gather
    assert abs(got - math.sqrt(12 * 9.0)) <= 14 * U32 * got, got
    assert chunk.syncs == [True]


def _float64_norm(chunks) -> float:
    """Every rank's parameters as they are now (no gather), float64, summed over ranks."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in chunks:
        for param in chunk.parameters():
            total += param.detach().double().square().sum()
    torch.distributed.all_reduce(total)
    return math.sqrt(float(total))


def overlapped_update_job() -> dict:
    """One distributed-optimizer step with ``overlap_param_gather`` at dp=2; the norms after it."""
    import functools

    from tests.test_layout_equality import GROUPS, HEADS, LAYERS, MICRO_BATCH, SEQ, _global_batch, _make_gpt
    from tests.tiny_gpt import run_schedule, seeded_chunks, token_mean_schedule
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.models import megatron_model as mm

    make = functools.partial(_make_gpt, dtype=torch.float32)
    runtime, chunks = seeded_chunks(ParallelLayout(), make, layers=LAYERS, heads=HEADS, groups=GROUPS)
    optim = mm.OptimSettings(
        lr=1e-2,
        weight_decay=0.0,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
    )
    chunks = mm.wrap_ddp(chunks, optim)
    mm.attach_schedule_hooks(chunks)
    optimizer = mm.build_optimizer(chunks, optim)
    schedule = token_mean_schedule(
        _global_batch(), micro_batch=MICRO_BATCH, seq=SEQ, dp=runtime.layout.dp, dp_rank=runtime.dp_rank
    )
    mm.zero_grads(chunks, optimizer)
    run_schedule(chunks, *schedule, seq=SEQ, micro_batch=MICRO_BATCH)
    assert optimizer.step()[0]
    stale = _float64_norm(chunks)  # each rank holds only its own shard of the update
    norm = global_weight_norm(chunks)
    syncs = []  # a later gather in the same step (weight send, checkpoint) has nothing left to do
    for chunk in chunks:
        sync = chunk.start_param_sync
        chunk.start_param_sync = lambda *a, _sync=sync, **k: (syncs.append(1), _sync(*a, **k))
    mm.gather_updated_params(chunks)
    return {
        "regathers": len(syncs),
        "stale": stale,
        "norm": norm,
        "updated": _float64_norm(chunks),
        "numel": max(p.numel() for c in chunks for p in c.parameters()),
    }


def test_the_norm_after_an_overlapped_distributed_optimizer_step_is_the_updated_weights(pool2):
    results = pool2.run(f"{__name__}:overlapped_update_job")
    got, updated, stale = results[0]["norm"], results[0]["updated"], results[0]["stale"]
    assert all(r["norm"] == got for r in results)  # one all-reduced value on every rank
    assert [r["regathers"] for r in results] == [0, 0]
    bound = (results[0]["numel"] + 2) * U32
    assert abs(stale - updated) > 10 * bound * updated, (stale, updated)  # the case can tell
    assert abs(got - updated) <= bound * updated, (
        f"norm {got!r} vs updated weights {updated!r}, stale {stale!r}"
    )
