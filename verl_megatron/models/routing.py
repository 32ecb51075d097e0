"""Routing replay for mixture-of-experts models (verl's "R3": rollout routing replay), model side.

The native rollout records, for every token it feeds through the model, the experts each MoE
router of this rank chose; training then routes every recorded token to those experts again,
so the old-log-prob forward and the update forward run the network the rollout sampled from,
even after an update has moved the router weights.

This module holds what touches the model: the router hook, the rollout's recorder and the
layout of recorded routes as a router sees its tokens. Keeping the routes between rollout and
training (per data-parallel rank) and driving the hooks in training is ``workers/routes.py``;
the config keys and their start-up checks are ``models/routing_replay.py``.

Where the hook sits: megatron's ``topk_routing_with_score_function`` asks
``router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)``
for the top-k (``moe_utils``), when a router has one. :class:`RouteHook` is that object. It
is not megatron's ``RouterReplay``: that class registers every instance in one process-wide
list (actor, reference and critic routers would mix), replays whole tensors (a token the
rollout never fed, such as the last one of a row, has no route to replay) and keeps only the
last call (a decode loop makes one call per step).

Shapes: the rollout returns ``routed_experts`` [rows, T, L, k] with the output batch (verl's
key): T = prompt + response columns, L = the MoE layers of *this pipeline stage* (global layer
``layer_numbers[i]`` for local index i), k = top-k; uint8 (int16 past 255 experts), with
:data:`UNRECORDED` where no route was recorded. Training lays the routes out as the router
sees its tokens (:func:`router_token_targets`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "NO_RECORDER",
    "ROUTES_KEY",
    "ROW_ID_KEY",
    "UNRECORDED",
    "NoRecorder",
    "RouteHook",
    "RouteRecorder",
    "install_hooks",
    "moe_routers",
    "route_dtype",
    "router_token_targets",
]

ROW_ID_KEY = "routing_row_id"
ROUTES_KEY = "routed_experts"
# uint8 routes use 255 for "not recorded" (experts 0..254); int16 ones use -1.
UNRECORDED = {torch.uint8: 255, torch.int16: -1}


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

    def record_into(self, sink: Callable[[torch.Tensor], None]) -> None:
        """Hand every call's computed indices [N, k] to ``sink`` until :meth:`release`."""
        self.mode, self.sink = "record", sink

    def aim(self, mode: str, target: torch.Tensor, counting: bool) -> None:
        """Compare with (``"observe"``) or replay (``"replay"``) ``target`` [N, k] in the next calls."""
        self.mode, self.target, self.counting = mode, target, counting

    def release(self) -> None:
        """Compute the top-k as megatron would again."""
        self.mode, self.sink, self.target = None, None, None

    def take_counts(self) -> torch.Tensor:
        """The agreement counts summed since the last take, on the host; restarts them at zero."""
        counts, self.counts = self.counts.double().cpu(), torch.zeros(2, dtype=torch.float64)
        return counts


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
            # megatron's own slot for a top-k replacement: installing one is the hook's purpose.
            router.router_replay = hook
        hooks.append(hook)
    return hooks


# ---------------------------------------------------------------------------- rollout side


class RouteRecorder:
    """Collects the routes of each native-rollout call into [rows, T, L, k].

    Built once on the chunks the rollout decodes with (it installs their hooks). Each call is
    ``with recorder.recording(rows, width): ...`` around the decode loop, which calls
    :meth:`begin` before each model step, naming the output rows of the step's batch rows and
    the cache column of its first token; :meth:`attach` then puts the call's routes in its output.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        self.hooks = install_hooks(chunks)
        self.layer_numbers = [h.layer_number for h in self.hooks]
        experts, self.topk = (self.hooks[0].num_experts, self.hooks[0].topk) if self.hooks else (0, 1)
        self.dtype = route_dtype(experts)
        self.routes = self._empty(0, 0)
        self._step: tuple[torch.Tensor, int, int] | None = None
        self._captured: dict[int, torch.Tensor] = {}

    def _empty(self, rows: int, width: int) -> torch.Tensor:
        shape = (rows, width, len(self.hooks), self.topk)
        return torch.full(shape, UNRECORDED[self.dtype], dtype=self.dtype)

    @contextlib.contextmanager
    def recording(self, rows: int, width: int) -> Iterator[None]:
        """Record one call of ``rows`` output rows x ``width`` cache columns."""
        self.routes, self._step = self._empty(rows, width), None
        self._captured.clear()
        for hook in self.hooks:
            hook.record_into(functools.partial(self._captured.__setitem__, hook.local_index))
        try:
            yield
            self._flush()
        finally:
            for hook in self.hooks:
                hook.release()

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
        """``output`` (a DataProto of the last call's rows) with ``routed_experts`` and the layer numbers."""
        output.batch[ROUTES_KEY] = self.routes
        output.meta_info["routed_experts_layers"] = list(self.layer_numbers)
        return output


class NoRecorder:
    """Stands in for :class:`RouteRecorder` when routes are not recorded."""

    def recording(self, rows: int, width: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def begin(self, rows: torch.Tensor, start: int, expand: int = 1) -> None:
        pass

    def attach(self, output: Any) -> Any:
        return output


NO_RECORDER = NoRecorder()


# ---------------------------------------------------------------------------- training layout


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
