"""Name and shard megatron parameters in a layout-independent way.

A megatron model on one rank holds a piece of the whole: its pipeline stage's
layers (numbered locally) and its tensor-parallel slice of each weight. Tests
and tools need the same weights whatever the layout, so this module names each
parameter by its *global* name (layer numbers counted over the whole model)
and moves whole tensors in and out of tensor-parallel shards along each
parameter's ``partition_dim``.

Note: "whole tensor" here means the concatenation of the tp shards. For fused
gate/up MLP weights that is not Hugging Face's [gate; up] layout; the HF
converter (``verl_megatron.models.convert``) handles that mapping.

Mixture-of-experts layers: a rank holds ``num_experts / ep`` routed experts, named here by
their global expert index (expert-parallel rank * local experts + local index), and each
expert weight is split over the *expert* tensor-parallel group (``etp``, which may differ
from tp); :func:`tp_placement` says which group a parameter is split over.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from verl_megatron.distributed import state
from verl_megatron.distributed.modules import unwrap

_LAYER_RE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.*)$")
# Routed-expert weights: the local spec's ``local_experts.<i>.`` and Transformer Engine's ``weight<i>``.
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12]\.(?:weight|bias))(\d+)$")


def is_expert_parameter(name: str) -> bool:
    """Whether global parameter ``name`` belongs to a routed expert (split over ep and etp)."""
    return ".mlp.experts." in name


def tp_placement(name: str) -> tuple[object, int, int]:
    """(group, size, rank) of the tensor-parallel split of parameter ``name``: expert weights are
    split over the expert tensor-parallel group, everything else over the tensor-parallel group."""
    if is_expert_parameter(name):
        return state.group("etp"), state.size("etp"), state.rank("etp")
    return state.group("tp"), state.size("tp"), state.rank("tp")


def _global_expert_name(rest: str, layer: torch.nn.Module) -> str:
    """``rest`` (a layer-relative name) with a local expert index replaced by the global one."""
    for pattern, fmt in (
        (_LOCAL_EXPERT_RE, "mlp.experts.local_experts.{index}.{tail}"),
        (_GROUPED_EXPERT_RE, "mlp.experts.{tail}{index}"),
    ):
        match = pattern.match(rest)
        if match:
            local = int(match.group(1) if pattern is _LOCAL_EXPERT_RE else match.group(2))
            tail = match.group(2) if pattern is _LOCAL_EXPERT_RE else match.group(1)
            offset = state.rank("ep") * layer.mlp.experts.num_local_experts
            return fmt.format(index=offset + local, tail=tail)
    return rest


def named_global_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield (global_name, local_param) for every parameter of this rank's model chunks.

    Global names count transformer layers over the whole model, and routed experts over
    all expert-parallel ranks, so a parameter has the same name under any pp/vpp/ep layout.
    Wrapper prefixes (``module.``) are dropped.
    """
    for chunk in chunks:
        inner = unwrap(chunk)
        for name, param in inner.named_parameters():
            match = _LAYER_RE.match(name)
            if match:
                layer = inner.decoder.layers[int(match.group(1))]
                rest = _global_expert_name(match.group(2), layer)
                name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
            yield name, param


def named_expert_biases(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, buffer) of every MoE router's expert bias on this rank (DeepSeek-V3's
    ``e_score_correction_bias``): a buffer, not a parameter, replicated over tp and ep, and
    updated by megatron after each optimizer step, not by the optimizer."""
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            bias = getattr(router, "expert_bias", None)
            if bias is not None:
                yield f"decoder.layers.{layer.layer_number - 1}.mlp.router.expert_bias", bias


def _tp_info(param: torch.Tensor) -> tuple[bool, int]:
    return bool(getattr(param, "tensor_model_parallel", False)), int(getattr(param, "partition_dim", -1))


def gather_tp(tensor: torch.Tensor, param: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """Concatenate the tensor-parallel shards of ``param`` (values given by ``tensor``)."""
    is_tp, dim = _tp_info(param)
    if not is_tp or tp_size == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def shard_tp(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's tensor-parallel slice of a whole tensor."""
    is_tp, dim = _tp_info(param)
    if not is_tp or tp_size == 1:
        return full
    return full.chunk(tp_size, dim=dim)[tp_rank]


def whole_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    is_tp, dim = _tp_info(param)
    if is_tp:
        shape[dim] *= tp_size
    return tuple(shape)


def gather_full_state(
    chunks: list[torch.nn.Module], *, grads: bool = False, only_tp_rank0: bool = True
) -> dict[str, torch.Tensor]:
    """Whole tensors (or their gradients, with ``grads``) of this pipeline stage, by global name.

    Collective over the tensor-parallel group (and, for MoE models, the expert tensor- and
    expert-parallel groups: every rank gets every expert). Ranks other than tp rank 0
    return an empty dict when ``only_tp_rank0`` (results are identical there).
    """
    out: dict[str, torch.Tensor] = {}
    for name, param in named_global_parameters(chunks):
        value = param.main_grad if grads and hasattr(param, "main_grad") else (param.grad if grads else param)
        if value is None:
            value = torch.zeros_like(param)
        group, size, _ = tp_placement(name)
        out[name] = gather_tp(value, param, group, size).cpu()
    if state.size("ep") > 1:
        experts = {name: t for name, t in out.items() if is_expert_parameter(name)}
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(state.size("ep"))]
        dist.all_gather_object(parts, experts, group=state.group("ep"))
        for part in parts:
            out.update(part)
    if only_tp_rank0 and state.rank("tp") != 0:
        return {}
    return out


@torch.no_grad()
def load_full_state(
    chunks: list[torch.nn.Module], make: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> None:
    """Set every parameter from ``make(global_name, whole_shape)``, sliced for this tp rank."""
    for name, param in named_global_parameters(chunks):
        _, tp_size, tp_rank = tp_placement(name)
        full = make(name, whole_shape(param, tp_size))
        if tuple(full.shape) != whole_shape(param, tp_size):
            raise ValueError(
                f"{name}: expected a whole tensor of shape {whole_shape(param, tp_size)}, got {tuple(full.shape)}"
            )
        param.copy_(shard_tp(full, param, tp_rank, tp_size).to(param.dtype))


def seeded_tensor(name: str, shape: tuple[int, ...], seed: int = 0, std: float = 0.05) -> torch.Tensor:
    """A deterministic random tensor keyed by (name, seed): the same under every layout.

    Norm weights are ones so the network starts well-conditioned.
    """
    if name.endswith("layer_norm_weight") or "norm.weight" in name or name.endswith("final_layernorm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(
        seed * 1_000_003 + sum(ord(c) * (i + 1) for i, c in enumerate(name))
    )
    return torch.randn(shape, generator=generator) * std
