"""Routing replay for mixture-of-experts models (verl's "R3": rollout routing replay).

The native rollout records, for every token it feeds through the model, the experts each MoE
router of this rank chose; training then routes every recorded token to those experts again,
so the old-log-prob forward and the update forward run the network the rollout sampled from,
even after an update has moved the router weights.

Where the hook sits: megatron's ``topk_routing_with_score_function`` asks
``router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)``
for the top-k (``moe_utils``), when a router has one. :class:`RouteHook` is that object. It
is not megatron's ``RouterReplay``: that class registers every instance in one process-wide
list (actor, reference and critic routers would mix), replays whole tensors (a token the
rollout never fed, such as the last one of a row, has no route to replay) and keeps only the
last call (a decode loop makes one call per step).

Shapes and storage:

- the rollout returns ``routed_experts`` [rows, T, L, k] with the output batch (verl's key):
  T = prompt + response columns, L = the MoE layers of *this pipeline stage* (global layer
  ``layer_numbers[i]`` for local index i), k = top-k; uint8 (int16 past 255 experts), with
  :data:`UNRECORDED` where no route was recorded;
- the trainer keeps it on the rank that generated it (:class:`RouteStore`), compacted to the
  row's attended tokens, and puts only a row id into the batch (``routing_row_id`` [rows]); a
  data-parallel rank fetches the rows it trains on from their owner just before the forward
  (point to point inside the data-parallel group, which holds the same layers), so a rank holds
  only its stage's layers and only the rows it generated or trains on;
- training lays the routes out as the router sees its tokens (:func:`router_token_targets`).

Metrics: ``actor/router_replay/hit_rate_{log_prob,update}`` is the fraction of recorded
(token, MoE layer) routes for which training's own top-k equals the recorded set (1.0 before
an update when rollout and training compute the same numbers), ``actor/router_replay/bytes_per_token``
the routing bytes a rank stores per token.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.modules import unwrap

__all__ = [
    "ROUTER_REPLAY_MODES",
    "RouteHook",
    "RouteRecorder",
    "RouteStore",
    "RouterReplayConfig",
    "RunRoutes",
    "TrainingRoutes",
    "check_config",
    "for_trainer",
    "install_hooks",
    "recorder_for",
    "router_token_targets",
]

ROUTER_REPLAY_MODES = ("disabled", "R3")
ROW_ID_KEY = "routing_row_id"
ROUTES_KEY = "routed_experts"
# uint8 routes use 255 for "not recorded" (experts 0..254); int16 ones use -1.
UNRECORDED = {torch.uint8: 255, torch.int16: -1}


@dataclass
class RouterReplayConfig:
    """Routing replay for MoE models (verl's ``actor.megatron.router_replay``)."""

    mode: str = "disabled"
    """``disabled``, or ``R3``: the actor's old-log-prob and update forwards route every token the
    rollout fed to the experts the rollout chose (needs ``rollout.enable_rollout_routing_replay``
    and the native rollout engine). verl's ``R2`` (replaying the old-log-prob routes) is not
    implemented here."""

    def __post_init__(self) -> None:
        from verl_megatron.errors import WorkerConfigError

        if self.mode not in ROUTER_REPLAY_MODES:
            hint = " (R2 is verl's old-log-prob replay, not implemented here)" if self.mode == "R2" else ""
            raise WorkerConfigError(
                f"router_replay.mode must be one of {list(ROUTER_REPLAY_MODES)}, got {self.mode!r}{hint}"
            )


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type holding expert ids and the UNRECORDED marker."""
    return torch.uint8 if num_experts < 255 else torch.int16


# ---------------------------------------------------------------------------- the router hook


class RouteHook:
    """``router.router_replay`` of one MoE layer: records, replays or just compares its top-k.

    Modes: ``None`` computes the top-k as megatron would; ``"record"`` also hands each call's
    indices [N, k] to ``sink``; ``"observe"`` and ``"replay"`` compare the computed top-k with
    ``target`` [N, k] (-1: no recorded route) and count agreements, and ``"replay"`` returns the
    target's experts wherever one is recorded.
    """

    def __init__(self, local_index: int, layer_number: int, num_experts: int, topk: int) -> None:
        self.local_index = local_index
        self.layer_number = layer_number
        self.num_experts = num_experts
        self.topk = topk
        self.mode: str | None = None
        self.sink: Callable[[torch.Tensor], None] | None = None
        self.target: torch.Tensor | None = None
        # [recorded routes seen, routes where the computed top-k equals the recorded one]
        self.counts = torch.zeros(2, dtype=torch.float64)
        self.counting = True

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's ``RouterReplay.get_replay_topk`` contract: (values [N, k], indices [N, k])."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record":
            self.sink(indices.detach())
            return values, indices
        if self.mode not in ("observe", "replay") or self.target is None:
            return values, indices
        target = self.target.to(indices.device)
        if target.shape != indices.shape:
            raise RuntimeError(
                f"routing replay, layer {self.layer_number}: the router sees {tuple(indices.shape)} "
                f"tokens x top-k but {tuple(target.shape)} recorded routes were laid out for it"
            )
        recorded = target[:, 0] >= 0
        same = (indices.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
        if self.counting:
            # Summed where the router runs; moved to the host once per schedule call (finish).
            self.counts = self.counts.to(indices.device) + torch.stack(
                [recorded.sum(), (same & recorded).sum()]
            )
        if self.mode == "observe":
            return values, indices
        chosen = torch.where(recorded[:, None], target, indices)
        # As megatron's replay: the router's own scores at the replayed experts, so the router
        # weights still get a gradient through the gate values.
        return scores.gather(1, chosen), chosen


def moe_routers(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The top-k routers of this rank's chunks, in chunk then layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def install_hooks(chunks: Sequence[torch.nn.Module]) -> list[RouteHook]:
    """A :class:`RouteHook` on every top-k router of ``chunks`` (kept if already there).

    A pipeline stage of only dense layers gets none. Raises ValueError for routers whose
    top-k replay cannot follow.
    """
    routers = moe_routers(chunks)
    hooks = []
    for i, router in enumerate(routers):
        config = router.config
        if config.moe_router_fusion or getattr(router, "routing_type", "") == "sinkhorn":
            raise ValueError(
                "routing replay: fused (moe_router_fusion) and sinkhorn routers bypass the replay hook"
            )
        if config.moe_expert_capacity_factor is not None:
            raise ValueError(
                "routing replay: token dropping (moe_expert_capacity_factor) would drop replayed routes"
            )
        hook = router.router_replay
        if not isinstance(hook, RouteHook):
            # layer_number is megatron's global 1-based number; stored 0-based.
            hook = RouteHook(i, int(router.layer_number) - 1, config.num_moe_experts, router.topk)
            router.router_replay = hook
        hooks.append(hook)
    return hooks


# ---------------------------------------------------------------------------- rollout side


class RouteRecorder:
    """Collects the routes of a native-rollout call into [rows, T, L, k].

    Used as ``with recorder.recording(): ...`` around the decode loop, which calls
    :meth:`begin` before each model step, naming the output rows of the step's batch rows and
    the cache column of its first token.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], rows: int, width: int) -> None:
        self.hooks = install_hooks(chunks)
        self.layer_numbers = [h.layer_number for h in self.hooks]
        experts, topk = (self.hooks[0].num_experts, self.hooks[0].topk) if self.hooks else (0, 1)
        self.dtype = route_dtype(experts)
        self.routes = torch.full(
            (rows, width, len(self.hooks), topk), UNRECORDED[self.dtype], dtype=self.dtype
        )
        self._step: tuple[torch.Tensor, int, int] | None = None
        self._captured: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        for hook in self.hooks:
            hook.mode, hook.sink = "record", functools.partial(self._captured.__setitem__, hook.local_index)
        try:
            yield
            self._flush()
        finally:
            for hook in self.hooks:
                hook.mode, hook.sink = None, None

    def begin(self, rows: torch.Tensor, start: int, expand: int = 1) -> None:
        """The next step's batch row b is output rows ``rows[b*expand:(b+1)*expand]``; its tokens
        sit at cache columns ``start``, ``start+1``, ... (empty ``rows``: record nothing)."""
        self._flush()
        self._step = (rows.cpu(), start, expand)

    def _flush(self) -> None:
        if self._step is None:
            return
        rows, start, expand = self._step
        batch = rows.numel() // expand
        # No rows: a step whose outputs are discarded (native.py's idle steps under ep).
        for layer, indices in self._captured.items() if batch else ():
            # The router sees [s, B] tokens flattened sequence-major: token (j, b) is row j*B + b.
            per_row = indices.view(-1, batch, indices.shape[-1]).transpose(0, 1).cpu()
            per_row = per_row.repeat_interleave(expand, dim=0)
            self.routes[rows, start : start + per_row.shape[1], layer] = per_row.to(self.dtype)
        self._step = None
        self._captured.clear()

    def attach(self, output: Any) -> Any:
        """``output`` (a DataProto of the same rows) with ``routed_experts`` and the layer numbers."""
        output.batch[ROUTES_KEY] = self.routes
        output.meta_info["routed_experts_layers"] = list(self.layer_numbers)
        return output


class _NoRecorder:
    """Stands in for :class:`RouteRecorder` when routes are not recorded."""

    def recording(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin(self, rows: torch.Tensor, start: int, expand: int = 1) -> None:
        pass

    def attach(self, output: Any) -> Any:
        return output


def recorder_for(chunks: Sequence[torch.nn.Module], rows: int, width: int, enabled: bool) -> Any:
    """A :class:`RouteRecorder` of ``rows`` x ``width`` tokens, or a no-op one when not ``enabled``."""
    return RouteRecorder(chunks, rows, width) if enabled else _NoRecorder()


# ---------------------------------------------------------------------------- the store


def _compact(routes: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the routes of its attended tokens in order: [n_i, L, k]."""
    return [r[m.bool()] for r, m in zip(routes, attention_mask)]


class RouteStore:
    """The routes of the rows this rank's rollout replica generated, and fetching them for training.

    Row ids encode the owner: ``id = replica + replicas * serial``; every rank numbers the rows
    of each generate call the same way, so every rank knows where a row lives.
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.rows: dict[int, torch.Tensor] = {}  # row id -> [n_tokens, L, k]
        self.fetched: dict[int, torch.Tensor] = {}
        self.serial = 0
        self.layer_numbers: list[int] | None = None
        self.dtype: torch.dtype | None = None
        self.row_shape: tuple[int, int] | None = None  # (L, k)

    def keep(self, output: Any, replica: int, replicas: int, store: bool = True) -> Any:
        """Take ``routed_experts`` out of a rollout output before it is gathered; add row ids.

        ``store=False`` (validation) drops the routes and adds no ids.
        """
        routes = output.batch.pop(ROUTES_KEY)
        layers = output.meta_info.pop("routed_experts_layers", None)
        if not store:
            return output
        count = routes.shape[0]
        serials = torch.arange(self.serial, self.serial + count, dtype=torch.long)
        self.serial += count
        ids = replica + replicas * serials
        for row_id, row in zip(ids.tolist(), _compact(routes, output.batch["attention_mask"])):
            self.rows[row_id] = row.clone()
        self.layer_numbers, self.dtype = layers, routes.dtype
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
                # int16 on the wire: NCCL has no uint8 restriction, but one dtype keeps both sides simple.
                flat = torch.cat([self.rows[i].reshape(-1) for i in owed[peer]]).to(torch.int16).to(device)
                ops.append(dist.isend(flat, global_peer, group=group))
            theirs = [i for i in missing if i % dp == peer]
            if theirs:
                sizes = [lengths[peer][i] * layers * topk for i in theirs]
                buffer = torch.empty(sum(sizes), dtype=torch.int16, device=device)
                ops.append(dist.irecv(buffer, global_peer, group=group))
                inbox.append((theirs, sizes, buffer))
        for op in ops:
            op.wait()
        for theirs, sizes, buffer in inbox:
            for row_id, part in zip(theirs, buffer.cpu().split(sizes)):
                self.fetched[row_id] = part.view(-1, layers, topk).to(self.dtype)


# ---------------------------------------------------------------------------- training side


def _replay_targets(row: torch.Tensor) -> torch.Tensor:
    """Stored routes [n, L, k] -> long with -1 where nothing was recorded."""
    marker = UNRECORDED.get(row.dtype, -1)
    out = row.long()
    return out.masked_fill(row == marker, -1) if marker != -1 else out


def router_token_targets(
    routes: Sequence[torch.Tensor], inputs: Any, sp_rank: int = 0, sp_size: int = 1
) -> torch.Tensor:
    """Recorded routes of a micro-batch laid out as its routers see the tokens: [L, N, k] long.

    Args:
        routes: per micro-batch row, its attended tokens' routes [n_i, L, k] (in token order).
        inputs: the micro-batch's ``batching.ModelInputs``: padded rows [b, S] hold row i's
            tokens at [i, 0:n_i]; one packed row [1, N] holds them back to back.
        sp_rank, sp_size: with sequence parallelism a tp rank's routers see only its 1/sp_size
            slice of the sequence dimension.

    The model transposes [b, S] to [S, b] and the router flattens that, so router token t is
    (t // b, t % b). Positions no row's token occupies (padding) get -1: routed as computed.
    """
    batch, width = inputs.input_ids.shape
    layers, topk = routes[0].shape[1], routes[0].shape[2]
    target = torch.full((width, batch, layers, topk), -1, dtype=torch.long)
    if batch == len(routes):
        for i, row in enumerate(routes):
            if row.shape[0] > width:
                raise RuntimeError(
                    f"routing replay: row {i} has {row.shape[0]} tokens, the micro-batch {width}"
                )
            target[: row.shape[0], i] = _replay_targets(row)
    else:
        if batch != 1:
            raise RuntimeError(
                f"routing replay: {len(routes)} rows in a micro-batch of shape {(batch, width)}"
            )
        offset = 0
        positions = inputs.position_ids[0]
        for i, row in enumerate(routes):
            n = row.shape[0]
            if offset + n > width or not torch.equal(positions[offset : offset + n], torch.arange(n)):
                raise RuntimeError(
                    f"routing replay: row {i}'s {n} tokens are not at packed positions {offset}..{offset + n - 1}"
                )
            target[offset : offset + n, 0] = _replay_targets(row)
            offset += n
    if sp_size > 1:
        target = target.chunk(sp_size, dim=0)[sp_rank]
    return target.reshape(-1, layers, topk).permute(1, 0, 2).contiguous()


class TrainingRoutes:
    """The actor's ``ModelRunner.route_replay``: sets every router's recorded routes before each
    micro-batch forward, then collects the agreement counts.

    ``replay=False`` only compares (the hit rate of training's own routing); True also replays.
    """

    def __init__(
        self, store: RouteStore, chunks: Sequence[torch.nn.Module], runtime: Any, replay: bool
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
            hook.mode, hook.target, hook.counting = self.mode, targets[hook.local_index], count

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one schedule call: afterwards the routers compute their own routes again."""
        try:
            yield
        finally:
            self.finish()

    def finish(self) -> None:
        for hook in self.all_hooks:
            self.counts[self.phase] += hook.counts.double().cpu()
            hook.counts = torch.zeros(2, dtype=torch.float64)
            hook.mode, hook.target = None, None
        self.routes = {}

    def metrics(self) -> dict[str, float]:
        """Hit rates and stored bytes per token over the whole job (collective over the world)."""
        device = self.runtime.device
        totals = torch.cat([self.counts["log_prob"], self.counts["update"]]).to(device)
        size = torch.tensor([self.store.bytes_per_token()], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
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


# ---------------------------------------------------------------------------- the trainer's side


class RunRoutes:
    """What the trainer holds when the rollout records routes: the store, and the actor's hook.

    ``replay`` (mode R3): the actor's forwards replay the routes; otherwise they only compare
    (the hit-rate metrics tell how far training's own routing is from the rollout's).
    """

    def __init__(self, runtime: Any, actor: Any, rollout: Any, replay: bool) -> None:
        if not hasattr(rollout, "record_routes"):
            raise ValueError(
                f"routing replay: the {type(rollout).__name__} rollout engine cannot record routes"
            )
        self.store = RouteStore(runtime)
        self.training = TrainingRoutes(self.store, actor.chunks, runtime, replay)
        actor.runner.route_replay = self.training
        rollout.record_routes = True

    def keep(self, output: Any, replica: int, replicas: int, validate: bool) -> Any:
        """A rollout output with its routes kept on this rank (training rollouts) or dropped."""
        return self.store.keep(output, replica, replicas, store=not validate)

    def end_step(self) -> dict[str, float]:
        """The step's metrics (collective over the world); forgets the step's routes."""
        metrics = self.training.metrics()
        self.store.clear()
        return metrics


def for_trainer(config: Any, runtime: Any, actor: Any, rollout: Any) -> RunRoutes | None:
    """The trainer's :class:`RunRoutes`, or None when the rollout records no routes."""
    if not config.rollout.enable_rollout_routing_replay:
        return None
    return RunRoutes(runtime, actor, rollout, replay=config.actor.megatron.router_replay.mode == "R3")


def check_config(config: Any) -> None:
    """Start-up checks of the routing-replay keys (raises ConfigError naming the key)."""
    from verl_megatron.errors import ConfigError

    mode = config.actor.megatron.router_replay.mode
    record = config.rollout.enable_rollout_routing_replay
    for role in ("ref", "critic"):
        if getattr(config, role).megatron.router_replay.mode != "disabled":
            raise ConfigError(
                f"{role}.megatron.router_replay.mode: only the actor replays routes; set it to disabled"
            )
    if mode == "disabled" and not record:
        return
    if mode == "R3" and not record:
        raise ConfigError(
            "actor.megatron.router_replay.mode=R3 replays the rollout's routes: set "
            "rollout.enable_rollout_routing_replay=true"
        )
    if config.rollout.name != "native":
        raise ConfigError(
            f"rollout.enable_rollout_routing_replay=true: rollout.name={config.rollout.name!r} cannot record "
            "MoE routes here (only the native engine does); use rollout.name=native or turn routing replay off"
        )
    if config.rollout.multi_turn.enable:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true does not support rollout.multi_turn yet"
        )
    if config.parallel.cp > 1:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true does not support context parallelism (parallel.cp > 1)"
        )
    if config.model.path:
        from verl_megatron.models.config import load_hf_config
        from verl_megatron.models.moe import MOE_MODEL_TYPES, read_moe_architecture

        try:
            hf_config = load_hf_config(config.model.path)
        except (ValueError, OSError):
            return  # check_model_fits names an unreadable checkpoint
        if read_moe_architecture(hf_config, hf_config.num_hidden_layers) is None:
            raise ConfigError(
                f"rollout.enable_rollout_routing_replay=true needs a mixture-of-experts model; model.path="
                f"'{config.model.path}' is dense (model_type {hf_config.model_type!r}, MoE types: "
                f"{list(MOE_MODEL_TYPES)})"
            )
    elif config.quickstart.enable:
        raise ConfigError(
            "rollout.enable_rollout_routing_replay=true needs a mixture-of-experts model; the quickstart model is dense"
        )
