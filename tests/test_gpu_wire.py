"""What crosses between ranks on a GPU job, checked on the CPU.

- The dtype guard (``distributed/wire.py``): NCCL has no int16 (nor uint16/uint32/uint64), gloo
  has, so every communication helper refuses those dtypes on every backend. Routing replay's
  exchange between dp ranks passes it (uint8 routes under 255 experts, int32 from 255 on, the
  values exact both ways) and trips it as soon as its wire dtype is int16 (the old one).
- The async trainer's weight send: the runner's parameter all-gather runs before the weights
  are read, and with a broadcast group (NCCL on GPU) each bucket's payload is broadcast once, on
  the weights' own device, only the small header going to each rollout rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_megatron.distributed.wire import NCCL_DTYPES, WireDtypeError, check_wire, wire_dtype

# ------------------------------------------------------------------ the guard


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex64])
def test_the_guard_refuses_what_nccl_cannot_carry(dtype) -> None:
    with pytest.raises(WireDtypeError, match="cannot be communicated"):
        check_wire("test", [torch.zeros(2, dtype=torch.uint8), torch.zeros(3, dtype=dtype)])


def test_the_guard_passes_nccl_dtypes_and_wire_dtype_widens_losslessly() -> None:
    check_wire("test", [torch.zeros(1, dtype=d) for d in NCCL_DTYPES])
    assert wire_dtype(torch.uint8) == torch.uint8 and wire_dtype(torch.bfloat16) == torch.bfloat16
    assert wire_dtype(torch.int16) == torch.int32 and wire_dtype(torch.uint32) == torch.int64
    values = torch.tensor([-32768, -1, 0, 299, 32767], dtype=torch.int16)
    assert torch.equal(values.to(wire_dtype(values.dtype)).to(torch.int16), values)
    with pytest.raises(WireDtypeError):
        wire_dtype(torch.uint64)


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


@pytest.mark.parametrize("dtype", FLOAT8)
def test_the_guard_carries_float8_but_refuses_to_reduce_it(dtype) -> None:
    # NCCL refuses float8 reductions ("Unsupported Float8 type for NCCL reduction"); gloo refuses
    # float8 altogether, so only the guard says it on a CPU run.
    check_wire("test", torch.zeros(3, dtype=dtype))
    with pytest.raises(WireDtypeError, match=rf"^test: a {dtype} tensor \(3,\) cannot be reduced"):
        check_wire("test", [torch.zeros(1), torch.zeros(3, dtype=dtype)], reduction=True)
    check_wire("test", [torch.zeros(1, dtype=d) for d in NCCL_DTYPES if d not in FLOAT8], reduction=True)


def float8_reductions_job() -> dict:
    """Each reduction of torch.distributed on a float8 tensor, and a broadcast of one, in a pool worker."""
    import torch.distributed as dist

    def f8(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float8_e4m3fn)

    calls = {
        "all_reduce": lambda: dist.all_reduce(f8(2)),
        "reduce": lambda: dist.reduce(f8(2), dst=0),
        "reduce_scatter": lambda: dist.reduce_scatter(f8(2), [f8(2), f8(2)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(f8(2), f8(4)),
        "_reduce_scatter_base": lambda: dist._reduce_scatter_base(f8(2), f8(4)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([f8(2)]),
        "broadcast": lambda: dist.broadcast(f8(2), src=0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "sent"
        except WireDtypeError as error:
            out[name] = str(error)
        except RuntimeError as error:  # gloo's own refusal, past the guard
            out[name] = f"past the guard: {error}"
    return out


def test_pool_workers_refuse_float8_reductions(pool2) -> None:
    for run in pool2.run(f"{__name__}:float8_reductions_job"):
        broadcast = run.pop("broadcast")
        assert not broadcast.startswith("torch.distributed."), broadcast  # NCCL broadcasts float8
        assert sorted(run) == sorted(
            [
                "all_reduce",
                "reduce",
                "reduce_scatter",
                "reduce_scatter_tensor",
                "_reduce_scatter_base",
                "all_reduce_coalesced",
            ]
        )
        for name, outcome in run.items():
            assert outcome.startswith(f"torch.distributed.{name}: a torch.float8_e4m3fn tensor"), outcome
            assert "cannot be reduced" in outcome, outcome


def test_the_collectives_of_distributed_are_guarded(monkeypatch) -> None:
    import verl_megatron.distributed.collective as collective

    monkeypatch.setattr(collective.dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(collective.torch, "float64", torch.int16)  # what a regression would send
    with pytest.raises(WireDtypeError, match="max_over_ranks"):
        collective.max_over_ranks(1.0, torch.device("cpu"))


# ------------------------------------------------------------------ routing replay between dp ranks

L, K = 2, 2


def _recorded(rank: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s routes [2 rows, 3 tokens, L, K]: ids up to experts-1 and the unrecorded marker."""
    from verl_megatron.models.routing import UNRECORDED

    g = torch.Generator().manual_seed(rank)
    routes = torch.randint(0, experts, (2, 3, L, K), generator=g).to(dtype)
    routes[:, -1] = UNRECORDED[dtype]  # each row's last token is never fed to the model
    routes[0, 0, 0, 0] = experts - 1
    return routes


def route_exchange_job(experts: int, wire: str | None = None) -> dict:
    """Each of 2 dp ranks keeps its replica's rows and fetches all 4 (``wire``: forced wire dtype)."""
    import torch.distributed as dist

    from verl_megatron.models.routing import ROUTES_KEY, route_dtype
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.routes import RouteStore

    rank, group = dist.get_rank(), dist.new_group([0, 1])
    try:
        runtime = SimpleNamespace(
            layout=SimpleNamespace(dp=2), dp_rank=rank, dp_group=lambda: group, device=torch.device("cpu")
        )
        store = RouteStore(runtime, route_dtype(experts))
        if wire is not None:
            store.wire = getattr(torch, wire)
        routes = _recorded(rank, experts, store.dtype)
        output = DataProto.from_dict(
            {ROUTES_KEY: routes, "attention_mask": torch.ones(2, 3, dtype=torch.long)}
        )
        store.keep(output, replica=rank, replicas=2)
        try:
            fetched = store.fetch(torch.arange(4))
        except WireDtypeError as error:
            return {"error": str(error)}
        return {"wire": store.wire, "fetched": {i: fetched[i].clone() for i in range(4)}}
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("experts", [4, 300])
def test_routes_cross_dp_ranks_in_an_nccl_dtype_and_exactly(pool2, experts) -> None:
    from verl_megatron.models.routing import route_dtype

    runs = pool2.run(f"{__name__}:route_exchange_job", experts=experts)
    stored = route_dtype(experts)
    for run in runs:
        assert run["wire"] == (torch.uint8 if experts < 255 else torch.int32)
        for row_id, row in run["fetched"].items():
            owner, serial = row_id % 2, row_id // 2  # ids: replica + replicas * serial
            assert row.dtype == stored and torch.equal(row, _recorded(owner, experts, stored)[serial])


def test_routes_in_int16_trip_the_guard(pool2) -> None:
    runs = pool2.run(f"{__name__}:route_exchange_job", experts=300, wire="int16")
    assert all("routing replay send: a torch.int16 tensor" in run["error"] for run in runs), runs


# ------------------------------------------------------------------ the async trainer's weight send


class _Work:
    def wait(self) -> None:
        pass


class _Group:
    """Records what a ProcessGroup was asked to send or broadcast."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []
        self.broadcast_tensors: list[torch.Tensor] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        self.sent.append((dst, tensors[0]))
        return _Work()

    def broadcast(self, tensors: list[torch.Tensor], options) -> _Work:
        assert options.rootRank == 0
        self.broadcast_tensors.append(tensors[0])
        return _Work()


def test_the_nccl_path_broadcasts_each_payload_once_on_its_device() -> None:
    from verl_megatron.rollout.weight_sync import WeightSender

    # meta tensors: no host copy can be made of them, so any .cpu() on the way would raise
    weights = [
        ("a", torch.empty(16, device="meta")),
        ("b", torch.empty(8, dtype=torch.bfloat16, device="meta")),
    ]
    weights.append(("c", torch.empty(40, dtype=torch.float64, device="meta")))  # 320 bytes: alone
    gloo, nccl = _Group(), _Group()
    stats = WeightSender(gloo, [3, 4, 5], 80 / 2**20, broadcast=nccl).send(iter(weights), version=7)
    assert stats.buckets == 2 and len(nccl.broadcast_tensors) == 2  # once per bucket, not per rank
    assert [t.device.type for t in nccl.broadcast_tensors] == ["meta", "meta"]
    assert [t.numel() for t in nccl.broadcast_tensors] == [16 * 4 + 8 * 2, 320]
    assert all(t.dtype == torch.uint8 for t in nccl.broadcast_tensors)
    # per bucket and rollout rank: the [4] message and the header, nothing payload-sized
    assert [dst for dst, _ in gloo.sent] == [3, 4, 5, 3, 4, 5] * 2
    assert all(t.device.type == "cpu" and t.numel() < 200 for _, t in gloo.sent)
    assert gloo.sent[0][1].tolist() == [7, gloo.sent[3][1].numel(), 80, 0]


class _Runner:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def gather_params(self) -> None:
        self.calls.append("gather_params")


@pytest.mark.parametrize("is_main", [True, False])
def test_the_weight_send_gathers_the_update_before_reading_it(monkeypatch, is_main) -> None:
    import verl_megatron.models.convert as convert
    from verl_megatron.trainer.async_trainer import AsyncRolloutLink
    from verl_megatron.trainer.trainer_checkpoint import RecentWeights

    calls: list[str] = []

    def iter_hf_weights(chunks, runtime):
        calls.append("read")
        yield "w", torch.zeros(1)

    monkeypatch.setattr(convert, "iter_hf_weights", iter_hf_weights)
    link = object.__new__(AsyncRolloutLink)
    link.runtime = SimpleNamespace(is_main=is_main)
    link.actor = SimpleNamespace(runner=_Runner(calls), chunks=[])
    link.sender = SimpleNamespace(send=lambda weights, version: calls.append(f"send {len(list(weights))}"))
    link.placement = SimpleNamespace(store=SimpleNamespace(set=lambda key, value: calls.append(key)))
    link.recent = RecentWeights(keep=1)  # the host copy an exact async resume re-sends
    link.config = SimpleNamespace(trainer=SimpleNamespace(save_freq=1))  # step 6 saves: version 5 is kept
    link.total_steps = 10
    link._send_weights(5)
    # every trainer rank gathers (a collective over dp) before the stream is read
    assert calls == (
        ["gather_params", "read", "send 1", "weights/5"] if is_main else ["gather_params", "read"]
    )
    assert list(link.recent.versions) == ([5] if is_main else [])


def test_the_runner_gathers_through_megatrons_param_sync() -> None:
    from verl_megatron.workers.model_runner import ModelRunner

    synced: list[tuple[str, bool]] = []

    def chunk(name: str, distributed: bool, overlap: bool) -> SimpleNamespace:
        config = SimpleNamespace(use_distributed_optimizer=distributed, overlap_param_gather=overlap)
        return SimpleNamespace(
            ddp_config=config, start_param_sync=lambda force_sync: synced.append((name, force_sync))
        )

    runner = object.__new__(ModelRunner)
    runner.chunks = [
        chunk("overlapped", True, True),
        chunk("synchronous", True, False),
        chunk("plain", False, False),
    ]
    runner.gather_params()
    # only the chunk whose all-gather waits for the next forward is gathered, synchronously
    assert synced == [("overlapped", True)]


def int16_all_reduce_job() -> str:
    """An int16 all-reduce, which gloo would carry: the pool's workers refuse it."""
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int16))
    except WireDtypeError as error:
        return str(error)
    return "sent"


def test_pool_workers_refuse_any_non_nccl_communication(pool2) -> None:
    # every multi-process CPU test runs in these workers: none may send what NCCL refuses
    assert all(
        r.startswith("torch.distributed.all_reduce: a torch.int16")
        for r in pool2.run(f"{__name__}:int16_all_reduce_job")
    )


@pytest.mark.parametrize("rollout_ranks", [[1], [1, 2]])
def test_mid_generation_refresh_is_off_only_for_a_shared_broadcast(rollout_ranks) -> None:
    # With several rollout ranks every one must join each broadcast: their segment loops end at
    # different points, so they take new weights only at step starts (which all reach alike).
    from verl_megatron.rollout.async_worker import RolloutWorker

    worker = object.__new__(RolloutWorker)
    arrived = {"weights/4"}
    worker.version, received = 3, []

    def receive() -> None:
        received.append(worker.version + 1)
        worker.version += 1

    worker._receive = receive
    store = SimpleNamespace(check=lambda keys: all(k in arrived for k in keys))
    worker.placement = SimpleNamespace(weights=_Group(), rollout_ranks=rollout_ranks, store=store)
    worker._refresh()
    assert received == ([4] if len(rollout_ranks) == 1 else [])
    worker.placement.weights = None  # gloo: each rank receives on its own
    worker._refresh()
    assert received == [4]
