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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.*)$")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def named_global_parameters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Yield (global_name, local_param) for every parameter of this rank's model chunks.

    Global names count transformer layers over the whole model, so a layer has
    the same name under any pp/vpp layout. Wrapper prefixes (``module.``) are dropped.
    """
    for chunk in chunks:
        inner = _unwrap(chunk)
        for name, param in inner.named_parameters():
            match = _LAYER_RE.match(name)
            if match:
                local = int(match.group(1))
                global_index = inner.decoder.layers[local].layer_number - 1
                name = f"decoder.layers.{global_index}.{match.group(2)}"
            yield name, param


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

    Collective over the tensor-parallel group. Ranks other than tp rank 0
    return an empty dict when ``only_tp_rank0`` (results are identical there).
    """
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    out: dict[str, torch.Tensor] = {}
    for name, param in named_global_parameters(chunks):
        value = param.main_grad if grads and hasattr(param, "main_grad") else (param.grad if grads else param)
        if value is None:
            value = torch.zeros_like(param)
        full = gather_tp(value, param, tp_group, tp_size)
        if tp_rank == 0 or not only_tp_rank0:
            out[name] = full.cpu()
    return out


@torch.no_grad()
def load_full_state(
    chunks: list[torch.nn.Module], make: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> None:
    """Set every parameter from ``make(global_name, whole_shape)``, sliced for this tp rank."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    for name, param in named_global_parameters(chunks):
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
