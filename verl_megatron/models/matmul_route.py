"""Linear and embedding layers whose weight-gradient path is chosen by a route object we own.

megatron's column/row parallel linears and vocabulary-parallel embedding compute their products
with megatron's own functions. Our subclasses here take a :class:`MatmulRoute` in their
constructor (the builder puts it in the layer spec's params, ``models/builder.py``) and consult
it at every call; switching a feature changes state on the route, never on megatron's objects.

Whoever builds a model to train it creates its route and hands the same object to the builder
and to the update (``workers/ppo_updates.py``). The builder routes a model only where the route
can act, a model built for the CPU (``use_cpu_initialization``: the kernels are CPU code, the
counterpart of megatron's CUDA ``gradient_accumulation_fusion``); a GPU build, or a build without
a route, keeps megatron's layers untouched. It routes every linear its layer spec names
(megatron's classes and our subclasses of them, e.g. GPT-OSS's expert down projection) except
multi-latent attention's two down projections, whose class megatron compares by identity, and
it rebuilds the GPTModel's input embedding and LM head as routed layers
(:func:`route_embedding_and_head`). Transformer Engine's linears are not megatron's classes and
are never routed; linears a module constructs itself (Qwen3-Next's DeltaNet projections) stay
megatron's.

Bitwise parity's batch-invariant kernel (``models/batch_invariant.py``) is a setting of the route
too, turned on for good by :meth:`MatmulRoute.use_batch_invariant_kernels` when a model's chunks are
switched: it comes ahead of every other path (packed decoding weights skip such layers). MoE
routers are routed for it alone: the spec's router (``MoESubmodules.router``) is built as
:data:`RoutedTopKRouter`, whose gating matmul takes the same kernel once the route is switched.

The update's switch is :meth:`MatmulRoute.accumulating_main_grad` (see
``models/grad_accumulation.py`` for the kernels and why): while it is on, a layer whose weight
is trainable, float32 and on the CPU, with a float32 DDP buffer (``main_grad``), adds its weight
gradient into that buffer inside the GEMM. Everything else (frozen or bf16 weights, sequence
parallelism, expert layers with explicit communication, tensor-parallel embeddings) falls through
to megatron's implementation per call, so numbers are megatron's wherever the switch is off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from verl_megatron.models.batch_invariant import linear_forward_impl, router_gating
from verl_megatron.models.grad_accumulation import (
    accumulates,
    embedding_into_main_grad,
    fusable_chunks,
    linear_into_main_grad,
)

__all__ = [
    "MatmulRoute",
    "RoutedColumnParallelLinear",
    "RoutedRowParallelLinear",
    "RoutedTopKRouter",
    "RoutedVocabParallelEmbedding",
    "accumulate_into_main_grad",
    "route_embedding_and_head",
    "route_spec",
    "routed_layers",
    "routed_linear_class",
    "routed_router_class",
]


class MatmulRoute:
    """How the routed layers of one model multiply: owned by whoever built the model, shared by
    all its chunks' layers. ``accumulate_main_grad`` is False outside
    :meth:`accumulating_main_grad` scopes; ``batch_invariant`` is set once, for good, by
    :meth:`use_batch_invariant_kernels`."""

    def __init__(self) -> None:
        self.accumulate_main_grad = False
        self.batch_invariant = False

    def use_batch_invariant_kernels(self) -> None:
        """From now on the routed linears multiply with the batch-invariant tiled kernel
        (``models/batch_invariant.py``, bitwise parity; ``BatchInvariance.switch`` calls this), ahead
        of every other path: weight gradients then take the kernel's ordinary backward, and
        decoding never uses packed weights."""
        self.batch_invariant = True

    @contextlib.contextmanager
    def accumulating_main_grad(self) -> Iterator[None]:
        """Within the scope (an update: forward, backward, recomputed forwards) routed layers add
        weight gradients into DDP's buffer where they may."""
        previous, self.accumulate_main_grad = self.accumulate_main_grad, True
        try:
            yield
        finally:
            self.accumulate_main_grad = previous


class _ConsultsRoute:
    """Mixed in before a megatron layer class: the constructor takes ``route`` (keyword) besides
    the layer's own arguments and keeps it for the layer's calls."""

    def __init__(self, *args: Any, route: MatmulRoute, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route = route


class _RoutedLinear(_ConsultsRoute):
    """The ``_forward_impl`` of megatron's parallel linears (same keyword arguments), through the
    route; mixed in before a megatron linear class by :func:`routed_linear_class`."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        if self.route.batch_invariant:
            return linear_forward_impl(input, weight, *args, **kwargs)
        if (
            self.route.accumulate_main_grad
            and not args
            and not getattr(self, "explicit_expert_comm", False)
            and not kwargs.get("sequence_parallel")
            and kwargs.get("grad_output_buffer") is None
            and accumulates(weight)
        ):
            return linear_into_main_grad(
                input,
                weight,
                kwargs.get("bias"),
                kwargs.get("allreduce_dgrad", False),
                kwargs.get("tp_group"),
            )
        return super()._forward_impl(input, weight, *args, **kwargs)


class _RoutedRouter(_ConsultsRoute):
    """The ``gating`` of megatron's top-k router (the [tokens, experts] logits), through the route;
    mixed in before megatron's router class by :func:`routed_router_class`. Routing itself (top-k,
    routing replay's hook, the auxiliary losses) stays megatron's."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if self.route.batch_invariant:
            return router_gating(self, input)
        return super().gating(input)


@functools.cache
def _routed(base: type, mixin: type = _RoutedLinear) -> type:
    name = f"Routed{base.__name__}"
    doc = f"``{base.__qualname__}`` (same parameters and arguments) consulting a ``route``."
    return type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, "__doc__": doc})


def routed_linear_class(module: Any) -> type | None:
    """The routed counterpart of ``module`` when it is megatron's column/row parallel linear class
    or a subclass of it (one class per input class), else None."""
    if (
        isinstance(module, type)
        and issubclass(module, (ColumnParallelLinear, RowParallelLinear))
        and not issubclass(module, _RoutedLinear)
    ):
        return _routed(module)
    return None


def routed_router_class(module: Any) -> type | None:
    """The routed counterpart of ``module`` when it is megatron's ``TopKRouter`` or a subclass of
    it (one class per input class), else None."""
    if isinstance(module, type) and issubclass(module, TopKRouter) and not issubclass(module, _RoutedRouter):
        return _routed(module, _RoutedRouter)
    return None


RoutedColumnParallelLinear = _routed(ColumnParallelLinear)
RoutedRowParallelLinear = _routed(RowParallelLinear)
RoutedTopKRouter = _routed(TopKRouter, _RoutedRouter)


class RoutedVocabParallelEmbedding(_ConsultsRoute, VocabParallelEmbedding):
    """megatron's ``VocabParallelEmbedding`` consulting ``route``: at tp=1 without the
    sequence-parallel scatter the lookup is the whole forward, and its gradient can go into the buffer."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if (
            self.route.accumulate_main_grad
            and self.tp_group.size() == 1
            and not self.reduce_scatter_embeddings
            and accumulates(self.weight)
        ):
            return embedding_into_main_grad(input_, self.weight)
        return super().forward(input_)


def routed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears and embeddings of ``model`` (bare, not DDP-wrapped) that consult a route
    (routers, whose route only picks their gating's kernel, are not listed)."""
    return [m for m in model.modules() if isinstance(m, (_RoutedLinear, RoutedVocabParallelEmbedding))]


@contextlib.contextmanager
def accumulate_into_main_grad(route: MatmulRoute | None, chunks: Sequence[torch.nn.Module]) -> Iterator[bool]:
    """Within the context, the layers consulting ``route`` (the one ``chunks`` were built with;
    None: none) add their weight gradients into DDP's buffer (``models/grad_accumulation.py``),
    provided ``grad_accumulation.fusable_chunks`` admits the DDP-wrapped ``chunks``: the scope is
    entered on the route, nothing is set on the modules. Yields whether the route was turned on."""
    if route is None or not fusable_chunks(chunks):
        yield False
        return
    with route.accumulating_main_grad():
        yield True


# Spec fields whose class megatron compares by identity (multi-latent attention's down projections
# pick their arguments by it): they keep megatron's layer, and its matmul.
_CLASS_COMPARED = frozenset({"linear_q_down_proj", "linear_kv_down_proj"})


def route_spec(spec: Any, route: MatmulRoute) -> Any:
    """``spec`` (a layer or block ModuleSpec, changed in place and returned) with every submodule
    that is megatron's column/row parallel linear built as its routed counterpart, ``route`` among
    the spec's params, and every MoE router (``MoESubmodules.router``, a builder called with
    ``config`` and ``pg_collection``) built as the routed router with ``route``."""
    if isinstance(spec, ModuleSpec):
        spec.submodules = route_spec(spec.submodules, route)
        return spec
    if isinstance(spec, list):
        return [route_spec(item, route) for item in spec]
    routed = routed_linear_class(spec)
    if routed is not None:
        return ModuleSpec(module=routed, params={"route": route})
    router = routed_router_class(spec)
    if router is not None:
        return functools.partial(router, route=route)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            if field.name not in _CLASS_COMPARED:
                setattr(spec, field.name, route_spec(getattr(spec, field.name), route))
    return spec


def route_embedding_and_head(model: torch.nn.Module, route: MatmulRoute) -> None:
    """Give a freshly built ``GPTModel`` routed input embedding and LM head, in place.

    ``GPTModel`` builds both itself (they are not in the layer spec); each is rebuilt as its
    routed counterpart on the meta device and takes over the built layer's Parameter objects, so
    weights, their megatron attributes and state-dict names stay. The rebuild is free only for a
    model built for the CPU: megatron then allocates with no device named (the meta context
    applies: no memory, and random init on meta tensors draws nothing), while for a GPU build it
    allocates on ``torch.cuda.current_device()`` and initializes from the CUDA generator whatever
    the context, so a GPU build is refused.
    """
    if not model.config.use_cpu_initialization:
        raise ValueError(
            "route_embedding_and_head: the model is not built for the CPU (use_cpu_initialization=False); "
            "megatron would allocate and initialize the rebuilt layers on the GPU"
        )
    embedding = getattr(model, "embedding", None)
    if embedding is not None and type(embedding.word_embeddings) is VocabParallelEmbedding:
        old = embedding.word_embeddings
        with torch.device("meta"):
            new = RoutedVocabParallelEmbedding(
                old.num_embeddings, old.embedding_dim, init_method=model.config.embedding_init_method,
                reduce_scatter_embeddings=old.reduce_scatter_embeddings, config=model.config,
                tp_group=old.tp_group, route=route,
            )  # fmt: skip
        new.weight = old.weight
        embedding.word_embeddings = new
    head = getattr(model, "output_layer", None) if getattr(model, "post_process", False) else None
    if type(head) is ColumnParallelLinear:
        with torch.device("meta"):
            new = RoutedColumnParallelLinear(
                head.input_size, head.output_size, config=model.config, init_method=model.config.init_method,
                bias=head.bias is not None, skip_bias_add=head.skip_bias_add, gather_output=head.gather_output,
                skip_weight_param_allocation=head.weight is None,
                embedding_activation_buffer=head.embedding_activation_buffer,
                grad_output_buffer=head.grad_output_buffer, tp_group=head.tp_group, route=route,
            )  # fmt: skip
        new.weight, new.bias = head.weight, head.bias
        model.output_layer = new
