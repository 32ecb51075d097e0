"""A dense transformer layer's decoding step as a handful of tensor ops (CPU, float32).

At decoding sizes (one token for a few dozen rows) a megatron layer's own forward spends a large
share of its time outside arithmetic: module calls, tensor-parallel region functions, argument
checks, bias-dropout-add closures. :func:`lean_layer` takes one layer's weights and
:class:`LeanLayer` runs the step on them, each product through the call's store
(packed_linear.py: packed once per weights version, in panels up to ``PANEL_MAX_ROWS`` rows where
the compiled kernel streams, else for oneDNN):

- the SwiGLU gate is one product with the SiLU fused, and the up projection one product with
  the multiplication by the gate fused (no [B, 2F] intermediate, no split);
- at tp=1 the output projection and the second MLP product add the residual in the same call;
- with the compiled kernels (cpu/kernels.py), an RMSNorm is one compiled pass over the rows
  instead of torch's ten-odd ops: 24 vs 82 us a call at [16, 896] with the caches flushed (as
  the weights' stream flushes them in a real step), 1 thread, AMD EPYC; 48 calls a step at
  Qwen2.5-0.5B's shape.

Measured on the 2-core CI machine, whole generate calls alternating with and without it (batch
64, medians): hidden 512, 64 new tokens 3.11 vs 3.61 s (5 pairs); hidden 256, 128 tokens 2.26 vs
2.61 s (4 pairs).

Only the layers it covers are replaced (SwiGLU MLP, torch RMSNorm / LayerNorm, megatron's local
linears). For anything else (other activations, q/k layernorm, MoE, Transformer Engine modules,
LoRA or any other forward hook, the parity kernels) :func:`lean_layer` returns None with the
reason and the decoder calls the modules as before. The result differs from the modules' by
float32 rounding only (fused additions in a different order).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_megatron.rollout.cpu.packed_linear import PackedWeights, batch_invariant_route, packing_available

__all__ = ["LeanLayer", "lean_layer"]


@dataclass
class _Packed:
    """One linear of the layer: its weight rows (packed on first use by the call's store) and bias."""

    weight: torch.Tensor  # the module's own [out, in]
    rows: slice | None
    bias: torch.Tensor | None


@dataclass
class LeanLayer:
    """One dense layer's decoding step; see the module docstring.

    ``attend(qkv)`` receives the qkv projection [s, B, groups, heads_per_group + 2, head_dim]
    (megatron's per-group order: the group's query heads, then its key, then its value) and
    returns the attention context [s, B, heads * head_dim].
    """

    norm1: Callable[[torch.Tensor], torch.Tensor]  # the module, or its compiled form (``_norm``)
    qkv: _Packed
    proj: _Packed
    norm2: Callable[[torch.Tensor], torch.Tensor]
    gate: _Packed  # SwiGLU: the gate and up halves of fc1, packed apart
    up: _Packed
    down: _Packed
    groups: int
    heads_per_group: int
    head_dim: int
    tp_group: object | None  # None at tp=1
    store: PackedWeights  # the call's packed weights

    def _linear(self, x: torch.Tensor, linear: _Packed, epilogue: str = "none", other=None, bias=True):
        return self.store.linear(
            x, linear.weight, linear.bias if bias else None, linear.rows, epilogue, other
        )

    def __call__(self, hidden: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        s, batch, width = hidden.shape
        x = self.norm1(hidden).reshape(s * batch, width)
        qkv = self._linear(x, self.qkv)
        context = attend(qkv.view(s, batch, self.groups, self.heads_per_group + 2, self.head_dim))
        hidden = self._project(context.reshape(s * batch, -1), self.proj, hidden.reshape(s * batch, width))
        x = self.norm2(hidden)
        gate = self._linear(x, self.gate, "swish")
        inner = self._linear(x, self.up, "mul", gate)
        return self._project(inner, self.down, hidden).view(s, batch, width)

    def _project(self, x: torch.Tensor, linear: _Packed, residual: torch.Tensor) -> torch.Tensor:
        """residual + x @ W^T + b, for a row-parallel W (summed over tp ranks before the bias)."""
        if self.tp_group is None:
            return self._linear(x, linear, "add", residual)
        out = self._linear(x, linear, bias=False)
        dist.all_reduce(out, group=self.tp_group)
        if linear.bias is not None:
            out = out + linear.bias
        return residual + out


def _compiled_rms_norm(kernel, weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    return kernel(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def _norm(module: torch.nn.Module, kernels: ModuleType | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` as a function: an RMSNorm with a float32 weight through the compiled
    ``rms_norm`` where ``kernels`` are given (equal to torch's up to float32 rounding), else the
    module itself."""
    weight = getattr(module, "weight", None)
    if (
        kernels is None
        or type(module) is not torch.nn.RMSNorm
        or weight is None
        or weight.dtype != torch.float32
    ):
        return module
    eps = module.eps if module.eps is not None else torch.finfo(torch.float32).eps
    return functools.partial(_compiled_rms_norm, kernels.rms_norm, weight.detach(), eps)


def _pack(module: torch.nn.Module, rows: slice | None = None) -> _Packed:
    bias = getattr(module, "bias", None)
    if bias is not None:
        bias = (bias if rows is None else bias[rows]).detach().contiguous()
    return _Packed(module.weight, rows, bias)


def _why_not(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` cannot run as a :class:`LeanLayer`, or None if it can."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    from verl_megatron.models.matmul_route import routed_linear_class

    if not packing_available():
        return "oneDNN packed linear unavailable"
    attn, mlp, config = getattr(layer, "self_attention", None), getattr(layer, "mlp", None), layer.config
    if type(attn) is not SelfAttention or type(mlp) is not MLP:
        return f"attention {type(attn).__name__} / mlp {type(mlp).__name__}"
    if not isinstance(getattr(layer, "cross_attention", None), IdentityOp):
        return "cross attention"
    linears = {"qkv": attn.linear_qkv, "proj": attn.linear_proj, "fc1": mlp.linear_fc1, "fc2": mlp.linear_fc2}
    kinds = {"qkv": ColumnParallelLinear, "proj": RowParallelLinear, "fc1": ColumnParallelLinear,
             "fc2": RowParallelLinear}  # fmt: skip
    for name, module in linears.items():
        # A routed linear (models/matmul_route.py) multiplies as megatron's outside an update
        # unless its route runs parity's batch-invariant kernels.
        own = (kinds[name], routed_linear_class(kinds[name]))
        if type(module) not in own or batch_invariant_route(module):
            return f"{name} is {type(module).__name__} with its own matmul"
        if module.weight.device.type != "cpu" or module.weight.dtype != torch.float32:
            return f"{name} weight is {module.weight.dtype} on {module.weight.device}"
    for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
        if type(norm) not in (torch.nn.RMSNorm, torch.nn.LayerNorm):
            return f"norm {type(norm).__name__}"
    if any(
        not isinstance(getattr(attn, n, None), (type(None), IdentityOp))
        for n in ("q_layernorm", "k_layernorm")
    ):
        return "q/k layernorm"
    hooked = [n for n, m in layer.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked or torch.nn.modules.module._global_forward_hooks:
        return f"forward hooks on {hooked or 'every module'} (e.g. LoRA adapters)"
    if config.apply_residual_connection_post_layernorm or config.fp32_residual_connection:
        return "residual from the normed input / in fp32"
    if config.num_query_groups < attn.world_size:
        return "fewer key/value groups than tensor-parallel ranks"
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        return "MLP other than SwiGLU"
    if (
        getattr(config, "use_te_activation_func", False)
        or getattr(config, "activation_func_clamp_value", None) is not None
        or getattr(config, "glu_linear_offset", 0.0) != 0.0
    ):
        return "activation with clamping / offset / Transformer Engine"
    return None


def lean_layer(
    layer: torch.nn.Module, tp_group, store: PackedWeights, kernels: ModuleType | None = None
) -> tuple[LeanLayer | None, str | None]:
    """(the layer's :class:`LeanLayer`, None), or (None, why not). ``tp_group``: None at tp=1;
    ``store``: the call's packed weights (packed_linear.py); ``kernels``: the compiled CPU kernels
    the decoder uses (cpu/kernels.py; None: the norms stay torch's)."""
    reason = _why_not(layer)
    if reason is not None:
        return None, reason
    attn, mlp = layer.self_attention, layer.mlp
    half = mlp.linear_fc1.weight.shape[0] // 2
    groups = attn.num_query_groups_per_partition
    plan = LeanLayer(
        norm1=_norm(layer.input_layernorm, kernels),
        qkv=_pack(attn.linear_qkv),
        proj=_pack(attn.linear_proj),
        norm2=_norm(layer.pre_mlp_layernorm, kernels),
        gate=_pack(mlp.linear_fc1, slice(0, half)),
        up=_pack(mlp.linear_fc1, slice(half, None)),
        down=_pack(mlp.linear_fc2),
        groups=groups,
        heads_per_group=attn.num_attention_heads_per_partition // groups,
        head_dim=attn.hidden_size_per_attention_head,
        tp_group=tp_group if attn.world_size > 1 else None,
        store=store,
    )
    return plan, None
