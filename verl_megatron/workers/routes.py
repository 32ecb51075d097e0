"""Routing replay (R3) on the training side: where recorded routes live and how training uses them.

The trainer keeps a rollout's ``routed_experts`` on the rank that generated it
(:class:`RouteStore`), compacted to each row's attended tokens, and puts only a row id into the
batch (``routing_row_id`` [rows]); a data-parallel rank fetches the rows it trains on from their
owner just before the forward (point to point inside the data-parallel group, which holds the
same layers), so a rank holds only its stage's layers and only the rows it generated or trains
on. :class:`TrainingRoutes` is the actor's model runner's replay: it points every router's hook
(``models/routing.py``) at the micro-batch's routes before each forward.

Metrics: ``actor/router_replay/hit_rate_{log_prob,update}`` is the fraction of recorded
(token, MoE layer) routes for which training's own top-k equals the recorded set (1.0 before
an update when rollout and training compute the same numbers), ``actor/router_replay/bytes_per_token``
the routing bytes a rank stores per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.modules import unwrap
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.distributed.wire import check_wire, wire_dtype
from verl_megatron.models.routing import (
    ROUTES_KEY,
    ROW_ID_KEY,
    RouteRecorder,
    install_hooks,
    router_token_targets,
)

__all__ = ["RouteStore", "RunRoutes", "TrainingRoutes"]


def _compact(routes: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the routes of its attended tokens in order: [n_i, L, k]."""
    return [r[m.bool()] for r, m in zip(routes, attention_mask)]


class RouteStore:
    """The routes of the rows this rank's rollout replica generated, and fetching them for training.

    Row ids encode the owner: ``id = replica + replicas * serial``; every rank numbers the rows
    of each generate call the same way, so every rank knows where a row lives.
    ``route_dtype``: the recorder's dtype of the routes (``models.routing.route_dtype``).
    """

    def __init__(self, runtime: Runtime, route_dtype: torch.dtype) -> None:
        self.runtime = runtime
        self.rows: dict[int, torch.Tensor] = {}  # row id -> [n_tokens, L, k]
        self.fetched: dict[int, torch.Tensor] = {}
        self.serial = 0
        self.layer_numbers: list[int] | None = None
        self.dtype = route_dtype
        # Between dp ranks: uint8 routes (< 255 experts) travel as they are; int16 ones as int32,
        # NCCL having no 16-bit integer type. Every rank derives it from the model alike.
        self.wire = wire_dtype(route_dtype)
        self.row_shape: tuple[int, int] | None = None  # (L, k)

    def keep(self, output: Any, replica: int, replicas: int, store: bool = True) -> Any:
        """Take ``routed_experts`` out of a rollout output before it is gathered; add row ids.

        ``store=False`` (validation) drops the routes and adds no ids.
        """
        routes = output.batch.pop(ROUTES_KEY)
        layers = output.meta_info.pop("routed_experts_layers", None)
        if not store:
            return output
        if routes.dtype != self.dtype:
            raise TypeError(
                f"routing replay: the rollout recorded {routes.dtype} routes, expected {self.dtype}"
            )
        count = routes.shape[0]
        serials = torch.arange(self.serial, self.serial + count, dtype=torch.long)
        self.serial += count
        ids = replica + replicas * serials
        for row_id, row in zip(ids.tolist(), _compact(routes, output.batch["attention_mask"])):
            self.rows[row_id] = row.clone()
        self.layer_numbers = layers
        self.row_shape = (routes.shape[2], routes.shape[3])
        output.batch[ROW_ID_KEY] = ids
        return output

    def clear(self) -> None:
        self.rows.clear()
        self.fetched.clear()

    def bytes_per_token(self) -> float:
        tokens = sum(r.shape[0] for r in self.rows.values())
        stored = sum(r.numel() * r.element_size() for r in self.rows.values())
        return stored / tokens if tokens else 0.0

    def fetch(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The routes of rows ``ids`` (collective over the data-parallel group: every dp rank calls)."""
        dp = self.runtime.layout.dp
        wanted = [int(i) for i in ids.tolist()]
        if dp > 1:
            self._exchange([i for i in wanted if i % dp != self.runtime.dp_rank and i not in self.fetched])
        out = {}
        for i in wanted:
            row = self.rows.get(i, self.fetched.get(i))
            if row is None:
                raise KeyError(f"routing replay: no recorded routes for batch row id {i}")
            out[i] = row
        return out

    def _exchange(self, missing: list[int]) -> None:
        """Point to point: every dp rank sends each peer the rows it owns that the peer asked for.

        Two small object all-gathers agree on who needs which rows and how many tokens each has;
        the routes themselves travel only from their owner to the rank that asked.
        """
        group, dp, me = self.runtime.dp_group(), self.runtime.layout.dp, self.runtime.dp_rank
        asks: list[list[int]] = [[] for _ in range(dp)]
        dist.all_gather_object(asks, missing, group=group)
        owed = {peer: [i for i in asks[peer] if i % dp == me] for peer in range(dp) if peer != me}
        lengths: list[dict[int, int]] = [{} for _ in range(dp)]
        mine = {i: int(self.rows[i].shape[0]) for ids in owed.values() for i in ids}
        dist.all_gather_object(lengths, mine, group=group)
        layers, topk = self.row_shape
        device = self.runtime.device
        ops, inbox = [], []
        for peer in range(dp):
            if peer == me:
                continue
            global_peer = dist.get_global_rank(group, peer)
            if owed[peer]:
                flat = torch.cat([self.rows[i].reshape(-1) for i in owed[peer]]).to(self.wire).to(device)
                check_wire("routing replay send", flat)
                ops.append(dist.isend(flat, global_peer, group=group))
            theirs = [i for i in missing if i % dp == peer]
            if theirs:
                sizes = [lengths[peer][i] * layers * topk for i in theirs]
                buffer = torch.empty(sum(sizes), dtype=self.wire, device=device)
                check_wire("routing replay receive", buffer)
                ops.append(dist.irecv(buffer, global_peer, group=group))
                inbox.append((theirs, sizes, buffer))
        for op in ops:
            op.wait()
        for theirs, sizes, buffer in inbox:
            for row_id, part in zip(theirs, buffer.cpu().split(sizes)):
                self.fetched[row_id] = part.view(-1, layers, topk).to(self.dtype)


class TrainingRoutes:
    """The actor's model-runner replay: sets every router's recorded routes before each
    micro-batch forward, then collects the agreement counts.

    ``replay=False`` only compares (the hit rate of training's own routing); True also replays.
    """

    def __init__(
        self, store: RouteStore, chunks: Sequence[torch.nn.Module], runtime: Runtime, replay: bool
    ) -> None:
        if runtime.layout.cp > 1:
            raise ValueError("routing replay does not support context parallelism (cp > 1)")
        self.store = store
        self.runtime = runtime
        self.mode = "replay" if replay else "observe"
        install_hooks(chunks)
        self.hooks_of = {id(chunk): install_hooks([chunk]) for chunk in chunks}
        self.all_hooks = [h for hooks in self.hooks_of.values() for h in hooks]
        self.routes: dict[int, torch.Tensor] = {}
        self.phase = "log_prob"
        self.counts = {
            "log_prob": torch.zeros(2, dtype=torch.float64),
            "update": torch.zeros(2, dtype=torch.float64),
        }
        config = unwrap(chunks[0]).config
        # The routers of a tp rank see 1/tp of the sequence under sequence parallelism.
        self.sp_size = runtime.layout.tp if config.sequence_parallel else 1
        self.last_counts: dict[str, list[float]] = {}

    def prepare(self, micro_batches: Sequence[Any], forward_only: bool) -> None:
        """Fetch the routes of every row of these micro-batches (collective over dp)."""
        missing = [mb for mb in micro_batches if ROW_ID_KEY not in mb.tensors]
        if missing:
            raise KeyError(
                f"routing replay is on but the batch has no '{ROW_ID_KEY}' (rows not generated by the "
                "native rollout with rollout.enable_rollout_routing_replay=true)"
            )
        ids = torch.cat([mb.tensors[ROW_ID_KEY] for mb in micro_batches]).unique()
        self.routes = self.store.fetch(ids)
        self.phase = "log_prob" if forward_only else "update"

    def before_forward(self, mb: Any, model: torch.nn.Module, count: bool = True) -> None:
        """Point ``model``'s routers at ``mb``'s routes (``count=False``: a schedule padding repeat)."""
        hooks = self.hooks_of.get(id(model), [])
        if not hooks:
            return
        rows = [self.routes[int(i)] for i in mb.tensors[ROW_ID_KEY].tolist()]
        sp_rank = self.runtime.tp_rank if self.sp_size > 1 else 0
        targets = router_token_targets(rows, mb.inputs, sp_rank, self.sp_size)
        for hook in hooks:
            hook.aim(self.mode, targets[hook.local_index], count)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one schedule call: afterwards the routers compute their own routes again."""
        try:
            yield
        finally:
            self.finish()

    def finish(self) -> None:
        for hook in self.all_hooks:
            self.counts[self.phase] += hook.take_counts()
            hook.release()
        self.routes = {}

    def metrics(self) -> dict[str, float]:
        """Hit rates and stored bytes per token over the whole job (collective over the world)."""
        device = self.runtime.device
        totals = torch.cat([self.counts["log_prob"], self.counts["update"]]).to(device)
        size = torch.tensor([self.store.bytes_per_token()], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            check_wire("routing replay metrics", [totals, size])
            dist.all_reduce(totals)
            dist.all_reduce(size, op=dist.ReduceOp.MAX)
        totals = totals.cpu().tolist()
        # (recorded routes checked, of which training's own top-k agreed) per phase, all ranks.
        self.last_counts = {"log_prob": totals[0:2], "update": totals[2:4]}
        out = {"actor/router_replay/bytes_per_token": float(size.item())}
        for name, (seen, hits) in (("log_prob", totals[0:2]), ("update", totals[2:4])):
            if seen:
                out[f"actor/router_replay/hit_rate_{name}"] = hits / seen
        for value in self.counts.values():
            value.zero_()
        return out


class RunRoutes:
    """Routing replay's pieces for one run, built once on the actor's chunks before the actor.

    ``recorder`` goes to the native rollout and ``training`` to the actor, each at construction;
    the trainer holds this object to keep each rollout's routes and to report the step's metrics.
    ``replay`` (mode R3): the actor's forwards replay the routes; otherwise they only compare
    (the hit-rate metrics tell how far training's own routing is from the rollout's).
    """

    def __init__(self, runtime: Runtime, actor_chunks: Sequence[torch.nn.Module], replay: bool) -> None:
        self.recorder = RouteRecorder(actor_chunks)
        self.store = RouteStore(runtime, self.recorder.dtype)
        self.training = TrainingRoutes(self.store, actor_chunks, runtime, replay)

    def keep(self, output: Any, replica: int, replicas: int, validate: bool) -> Any:
        """A rollout output with its routes kept on this rank (training rollouts) or dropped."""
        return self.store.keep(output, replica, replicas, store=not validate)

    def end_step(self) -> dict[str, float]:
        """The step's metrics (collective over the world); forgets the step's routes."""
        metrics = self.training.metrics()
        self.store.clear()
        return metrics
