"""Batch-invariant kernels: a token's numbers do not depend on which other tokens share its batch.

A row of ``x @ W.T`` computed by one GEMM differs in the last bits with the number of rows M
(on this CPU, M=1 and M=2 differ by 3e-6): BLAS picks its blocking and kernels from the shape.
The rollout decodes a few rows at a time while training runs thousands, so the log-prob of a
sampled token computed during generation and the one the trainer recomputes (``old_log_probs``)
differ. Bitwise parity needs every reduction to happen in the same order in both paths:

- **linear layers** (:func:`matmul_rows`): rows are cut into tiles of :data:`TILE_ROWS` rows
  (the last one zero-padded) and multiplied as one batched GEMM of [TILE_ROWS, K] x [K, N]
  items. Every item has the same shape whatever M, so a row's result depends only on the row
  and the weight (checked empirically in ``tests/test_rollout_parity.py`` at several thread
  counts). The backward pass is an ordinary one (:class:`_TiledLinear`). The model's linears
  run it through their matmul route (``models/matmul_route.py``: :func:`enable` turns the route
  on), so the model must be built for the CPU with a route.
- **attention** (:func:`attention`): each sequence's keys sit in canonical columns (column j
  holds the sequence's j-th token, whatever the batch layout: left-padded prompt, padded row or
  packed segment) and are padded to one fixed key length L for every call, masked with -inf.
  Q K^T and P V then run as tiled GEMMs of fixed shape, and the softmax runs over rows of
  length L, so the reduction over keys has the same length and order in the decoder (one query
  per row, KV cache) and in training (all queries of a sequence at once).
- **rotary positions** restart at 0 in every packed segment (:meth:`BatchInvariance.rotary_positions`,
  applied per model call by ``models/rotary_positions.py``); megatron's rotary embedding
  otherwise numbers the whole packed row, which gives the same attention mathematically but
  not bitwise.
- **MoE routers** (:func:`router_gating`): the gating matmul is tiled the same way, through the
  router's matmul route (the builder builds megatron's ``TopKRouter`` as ``matmul_route.RoutedTopKRouter``);
  the experts are column/row-parallel linears. **LoRA adapters**' A and B products use :func:`linear` too.
- **the vision tower** of a vision-language model (its linears, patch embedding and mergers, DeepStack's
  too: ``families/qwen2_vl_vision.MatmulSite``) uses :func:`linear`: the rollout runs it once on a
  batch's images, the actor on a micro-batch's, and a patch's features must not depend on the others.
  Its attention already runs window by window (one SDPA call per window of one image). 3-D rotary ids
  turn each token by its own ids (:meth:`BatchInvariance.rotary_positions` leaves them alone).
- RMSNorm, the activation, softmax and log-softmax work row by row and were measured to give
  the same bits for a row whatever the number of rows; the tensor-parallel all-reduce adds the
  same two partial sums in both paths.

The mode is a value, :class:`BatchInvariance` (the fixed L), made once from the config
(``rollout.bitwise_parity``) and handed to what needs it: :func:`enable` switches a model's
chunks to these kernels and gives each core attention the object; the model runner and the
decoder take it as a constructor argument.
Needs megatron's local layer spec (Transformer Engine kernels cannot be routed or swapped).
Verified in float32 and bfloat16 on CPU (MKL); that a batched GEMM item's result does not depend on the
number of items is an empirical property of the BLAS, not yet checked on a GPU (cuBLAS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verl_megatron.distributed.modules import unwrap
from verl_megatron.models.families.qwen2_vl_vision import MatmulSite
from verl_megatron.models.lora import ColumnAdapter, RowAdapter
from verl_megatron.models.sdpa_attention import SDPADotProductAttention

__all__ = [
    "TILE_ROWS",
    "BatchInvariance",
    "attention",
    "enable",
    "linear_forward_impl",
    "matmul_rows",
    "router_gating",
    "self_attention",
]

TILE_ROWS = 16
"""Rows per GEMM item. Smaller tiles waste less on padding when decoding few rows; larger ones
run training GEMMs closer to full speed. Both paths must use the same value."""

_KEY_LENGTH_MULTIPLE = 16  # keeps L fixed when sequence parallelism rounds a micro-batch's width up


# ------------------------------------------------------------------ matrix products


def matmul_rows(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N], each row computed by a [TILE_ROWS, K] x [K, N] GEMM item."""
    rows, inner = x.shape
    pad = -rows % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, inner)])
    tiles = x.shape[0] // TILE_ROWS
    out = torch.bmm(x.reshape(tiles, TILE_ROWS, inner), weight_t.unsqueeze(0).expand(tiles, *weight_t.shape))
    return out.reshape(tiles * TILE_ROWS, weight_t.shape[1])[:rows]  # rows may be 0 (an idle expert)


def _batched_matmul_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, M, K] @ b [n, K, N] -> [n, M, N], each row of each item by a [TILE_ROWS, K] x [K, N] item."""
    n, rows, inner = a.shape
    pad = -rows % TILE_ROWS
    if pad:
        a = torch.cat([a, a.new_zeros(n, pad, inner)], dim=1)
    tiles = a.shape[1] // TILE_ROWS
    b = b.unsqueeze(1).expand(n, tiles, *b.shape[1:]).reshape(n * tiles, *b.shape[1:])
    out = torch.bmm(a.reshape(n * tiles, TILE_ROWS, inner), b)
    return out.reshape(n, tiles * TILE_ROWS, -1)[:, :rows]


class _TiledLinear(torch.autograd.Function):
    """y = x @ weight.T with a batch-invariant forward and PyTorch's ordinary backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        out = matmul_rows(x.reshape(-1, x.shape[-1]), weight.t())
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias): a row's result does not depend on the other rows."""
    out = _TiledLinear.apply(x, weight)
    return out if bias is None else out + bias


def linear_forward_impl(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    async_grad_allreduce=None,
    tp_group=None,
) -> torch.Tensor:
    """Drop-in for megatron's ``linear_with_grad_accumulation_and_async_allreduce`` (same
    arguments, same communication), with the batch-invariant matmul: what a routed linear
    (``models/matmul_route.py``) runs once its route has the batch-invariant kernels on."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if sequence_parallel:
        # Forward: all-gather along the sequence; backward: reduce-scatter (megatron's order).
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        # Forward: identity; backward: all-reduce of the input gradient over tp.
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return linear(input, weight, bias)


# ------------------------------------------------------------------ attention


def attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention with keys in canonical columns.

    Args:
        query: [B, H, S, D] (H = G * P query heads, group-major as in megatron).
        keys, values: [B, G, L, D], column j of a row holding its sequence's j-th token
            (anything where ``allowed`` is False).
        allowed: [B, 1, S, L] bool; every query must allow at least one column.
        scale: softmax scale applied to the scores.

    Returns:
        [B, H, S, D]. A query's output depends only on its own row of ``query``, the row's keys
        and values and L, never on B, S or the position of the query among them.
    """
    batch, heads, steps, dim = query.shape
    groups, length = keys.shape[1], keys.shape[2]
    per_group = heads // groups
    # Each (row, group) is one item; its P*S query rows are tiled by _batched_matmul_rows.
    q = query.reshape(batch * groups, per_group * steps, dim)
    k_t = keys.reshape(batch * groups, length, dim).transpose(1, 2)
    scores = _batched_matmul_rows(q, k_t).reshape(batch, groups, per_group, steps, length) * scale
    scores = scores.masked_fill(~allowed.view(batch, 1, 1, steps, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(batch * groups, per_group * steps, length)
    out = _batched_matmul_rows(probs, values.reshape(batch * groups, length, dim))
    return out.reshape(batch, heads, steps, dim)


def _segments(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first allowed key [b, S], position in its segment [b, S]) of each query of a
    block-causal ``allowed`` [b, S, S]; ValueError for a mask that is not block-causal."""
    steps = allowed.shape[-1]
    column = torch.arange(steps, device=allowed.device)
    start = torch.where(allowed, column, steps).amin(dim=-1)
    expected = (column[None, None, :] >= start[..., None]) & (column[None, None, :] <= column[None, :, None])
    if not torch.equal(expected, allowed):
        raise ValueError(
            "batch-invariant attention: the attention mask is not causal within contiguous segments"
        )
    return start, column[None, :] - start


def self_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    key_length: int,
    scale: float,
) -> torch.Tensor:
    """Training-side core attention in megatron's layout, through :func:`attention`.

    Args:
        query: [S, b, H, D]; key, value: [S, b, G, D] (self-attention, causal).
        attention_mask: None (causal over each row) or [b|1, 1, S, S] bool, True where a query
            may NOT attend: block-causal for packed rows.
        key_length: the fixed L (see the module docstring); no segment may be longer.
        scale: softmax scale.

    Returns:
        [S, b, H * D].

    Each causal segment (a padded row, or a packed sequence) is moved to its own canonical row
    [L] (gathers, so the backward is ordinary autograd), attended, and moved back.
    """
    steps, batch, heads, dim = query.shape
    device = query.device
    column = torch.arange(steps, device=device)
    if attention_mask is None:
        start = torch.zeros(batch, steps, dtype=torch.long, device=device)
        offset = column[None, :].expand(batch, steps)
    else:
        allowed = ~attention_mask.bool()[:, 0].expand(batch, steps, steps)
        start, offset = _segments(allowed)
    longest = int(offset.max()) + 1
    if longest > key_length:
        raise ValueError(
            f"batch-invariant attention: a sequence of {longest} tokens exceeds the fixed key length "
            f"{key_length} (rollout.prompt_length + rollout.response_length)"
        )
    # Segment id of each token: (row, start) pairs, numbered in order.
    seg_key = torch.arange(batch, device=device)[:, None] * (steps + 1) + start
    seg_keys, seg_id = torch.unique(seg_key.reshape(-1), return_inverse=True)
    segments = seg_keys.numel()
    # Flat index of each token in megatron's [S, b] order, listed in [b, S] order like seg_id.
    token = (column[None, :] * batch + torch.arange(batch, device=device)[:, None]).reshape(-1)

    def canonical(t: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """t [S, b, heads, D] -> [segments, heads, width, D] (zeros past a segment's end), slots."""
        slot = seg_id * width + offset.reshape(-1)
        source = torch.full((segments * width,), steps * batch, dtype=torch.long, device=device)
        source[slot] = token  # the index past the end selects the zero row
        flat = t.reshape(steps * batch, t.shape[2], dim)
        flat = torch.cat([flat, flat.new_zeros(1, t.shape[2], dim)])
        return flat.index_select(0, source).view(segments, width, t.shape[2], dim).transpose(1, 2), slot

    # Keys over the fixed length L; queries only as many as the longest segment (a query's
    # result does not depend on how many others there are).
    (k, _), (v, _) = canonical(key, key_length), canonical(value, key_length)
    q, slot = canonical(query, longest)
    # Query slot j sees key columns 0..j; slots past a segment's end are never read.
    allowed = (
        torch.arange(key_length, device=device)[None, :] <= torch.arange(longest, device=device)[:, None]
    )
    out = attention(q, k, v, allowed.view(1, 1, longest, key_length).expand(segments, 1, -1, -1), scale)
    out = out.transpose(1, 2).reshape(segments * longest, heads * dim)
    # slot is in [b, S] order; megatron wants [S, b, H * D].
    return out.index_select(0, slot).view(batch, steps, heads * dim).transpose(0, 1).contiguous()


# ------------------------------------------------------------------ switching a model


def _check(chunk: torch.nn.Module) -> None:
    config = chunk.config
    where = "rollout.bitwise_parity"
    cores = [m for m in chunk.modules() if type(m).__name__.endswith("DotProductAttention")]
    if any(not isinstance(m, SDPADotProductAttention) for m in cores):
        raise ValueError(
            f"{where} needs megatron's local layer spec (model.use_te=false): Transformer Engine's "
            "attention and linear kernels cannot be made batch-invariant here"
        )
    if config.gradient_accumulation_fusion or config.defer_embedding_wgrad_compute:
        raise ValueError(
            f"{where}: gradient_accumulation_fusion / defer_embedding_wgrad_compute are not supported"
        )
    if config.attention_dropout or config.hidden_dropout:
        raise ValueError(
            f"{where} needs attention_dropout = hidden_dropout = 0 (dropout is not batch-invariant)"
        )
    if config.context_parallel_size > 1:
        raise ValueError(f"{where} does not support context parallelism (parallel.cp > 1)")
    if getattr(config, "moe_shared_expert_gate", False):
        # The shared expert's gate is a plain F.linear inside megatron's forward.
        raise ValueError(f"{where} does not support a gated shared expert (e.g. qwen2_moe)")


def _linear_routes(chunk: torch.nn.Module) -> list:
    """The routes (``models/matmul_route.MatmulRoute``) the column/row parallel linears and the
    MoE routers of ``chunk`` consult; ValueError naming the first one built without a route."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import TopKRouter

    routes = []
    for name, module in chunk.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, TopKRouter)):
            route = getattr(module, "route", None)
            if route is None:
                kind = "router" if isinstance(module, TopKRouter) else "linear"
                raise ValueError(
                    f"rollout.bitwise_parity: {kind} {name} ({type(module).__name__}) consults no matmul route; "
                    "the batch-invariant kernels need a model built for the CPU with one "
                    "(build_gpt_chunks(..., route=MatmulRoute()))"
                )
            routes.append(route)
    return routes


def router_gating(router: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """Megatron's ``TopKRouter.gating`` (logits in ``moe_router_dtype``) with the tiled matmul:
    input [N, hidden] -> [N, experts]; what a routed router (``models/matmul_route.py``) runs once
    its route has the batch-invariant kernels on.

    The rest of the MoE layer already treats each token alone: softmax / top-k per row, experts
    made of the column/row-parallel linears switched here, and the unpermutation adds a
    token's k weighted expert outputs in expert order (a scatter-add over sorted rows).
    """
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype, input.dtype)
    bias = None if router.bias is None else router.bias.to(dtype)
    return linear(input.to(dtype), router.weight.to(dtype), bias)


def round_key_length(length: int) -> int:
    """The fixed key length L for sequences of at most ``length`` tokens."""
    return -(-length // _KEY_LENGTH_MULTIPLE) * _KEY_LENGTH_MULTIPLE


@dataclass(frozen=True)
class BatchInvariance:
    """The bitwise parity mode: every attention runs over the fixed key length ``key_length`` (L).

    Made once (:meth:`for_sequences`) and passed explicitly to the attention modules
    (:meth:`switch`), the model runner and the decoder.
    """

    key_length: int

    @classmethod
    def for_sequences(cls, max_sequence_length: int) -> BatchInvariance:
        """The mode for sequences of at most ``max_sequence_length`` tokens (prompt + response)."""
        return cls(round_key_length(max_sequence_length))

    def self_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """:func:`self_attention` over this mode's L: query [S, b, H, D] -> [S, b, H * D]."""
        return self_attention(query, key, value, attention_mask, self.key_length, scale)

    def rotary_positions(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """[S] rotary position of each column of a micro-batch's ``position_ids`` [b, S]: a
        token's position within its own sequence (padded rows start at 0, packed rows hold one row).
        None for 3-D (multimodal) ids [b, 3, S]: the multimodal rotary turns every token by its own ids."""
        if position_ids.dim() == 3:
            return None
        if position_ids.dim() != 2 or not bool((position_ids == position_ids[:1]).all()):
            raise ValueError(
                "batch-invariant model: rows of position_ids differ; rotary positions are shared by the "
                "rows of a micro-batch (padded rows start at 0, packed rows hold one row)"
            )
        return position_ids[0].long()

    def switch(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Switch model chunks (DDP-wrapped or bare) to the batch-invariant kernels, in place.

        The linears and MoE routers multiply through the route they were built with
        (``models/matmul_route.py``): the route of each is turned to the tiled kernel, nothing is
        set on megatron's layers. So the chunks must be built for the CPU with a route
        (``build_gpt_chunks(route=...)``)."""
        bare = [unwrap(c) for c in chunks]
        routes = []
        for chunk in bare:
            _check(chunk)
            routes.extend(_linear_routes(chunk))
        for route in routes:
            route.use_batch_invariant_kernels()
        for chunk in bare:
            for module in chunk.modules():
                if isinstance(module, SDPADotProductAttention):
                    module.use_fixed_length_attention(self.self_attention)
                elif isinstance(module, (ColumnAdapter, RowAdapter, MatmulSite)):  # LoRA, the vision tower
                    module.use_matmul(linear)


def enable(chunks: Sequence[torch.nn.Module], max_sequence_length: int) -> BatchInvariance:
    """Switch model chunks to the batch-invariant kernels; returns the mode to hand to the
    model runner (``ModelRunner(batch_invariance=...)``) and the decoder.

    ``max_sequence_length`` bounds every sequence the model will see (prompt + response); the
    attention's fixed key length L is that rounded up (:func:`round_key_length`).
    """
    mode = BatchInvariance.for_sequences(max_sequence_length)
    mode.switch(chunks)
    return mode
